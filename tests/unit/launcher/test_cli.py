"""The command-line contract the entry modules share (``k2.launcher.cli``): ``--help`` on every tool."""

from __future__ import annotations

import importlib

import pytest

from support.helpers import run_tool

TOOLS = ["train", "plan", "data", "bench", "submit"]


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_exits_0_with_usage_config_tree_and_examples(capsys, tool, flag):
    """``k2-<tool> --help`` (also after overrides) prints its usage, the config tree and the recipes of
    each group, and example overrides; nothing runs and nothing reaches Hydra's parser."""
    from k2.config.recipes import RECIPES_DIR

    main = importlib.import_module(f"k2.launcher.{tool}").main
    rc, out, err = run_tool(capsys, main, ["model=kimi_k2", flag])
    assert rc == 0, err
    assert out.startswith(f"usage: k2-{tool} ")
    assert str(RECIPES_DIR) in out and "k2_tiny, kimi_k2" in out  # the tree and a group's recipes
    assert "examples:" in out and f"k2-{tool} " in out.split("examples:")[1]
    assert "group.key=value" in out and "error" not in err
    # the hardware profiles by the setting that reads them, not as a group (hardware=b200 is no group)
    groups = out.split("recipes per group:")[1].split("exit status")[0]
    assert "\n  hardware " not in groups and "\n  published " not in groups
    assert "hardware profiles (plan.hardware=NAME, or a PATH.yaml): b200, b300, gb200_nvl72" in out


def test_a_hardware_group_override_names_the_setting_that_picks_a_profile(capsys):
    from k2.launcher.plan import main

    rc, _, err = run_tool(capsys, main, ["hardware=b200"])
    assert rc == 2 and "unknown config key 'hardware': a hardware profile is chosen with plan.hardware=NAME" in err


def test_k2_train_refuses_a_bad_setting_without_importing_megatron():
    """k2-train's parent checks every setting (``prepare_run``) before it imports the trainer: a bad
    setting is one error line and exit 2, and megatron-core (several seconds of CPU per process) was
    never imported for it. A fresh interpreter, since this test session has imported everything."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom k2.launcher.train import main\nrc = main(['train.save_interval=0'])\n"
        "print(rc, sorted(m for m in ('megatron.core', 'k2.model.activation_memory') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["2", "[]"], proc.stdout + proc.stderr[-2000:]
    assert proc.stderr.strip().startswith("k2-train: error: train.save_interval=0"), proc.stderr


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.iterz=3", "unknown config key 'train.iterz' (did you mean 'train.iters'?)"),
        ("schedule.phases.0.lr_style=linaer", "schedule.phases.0.lr_style='linaer'; allowed: constant, linear"),
    ],
)
def test_k2_train_refuses_a_mistyped_key_before_importing_torch(override, message):
    """A mistyped key or value is refused while the config is composed, before torch (and so megatron-core)
    is imported: seconds of CPU per process, tens of seconds on a loaded machine. A fresh interpreter."""
    import subprocess
    import sys

    code = (
        f"import sys\nfrom k2.launcher.train import main\nrc = main([{override!r}])\n"
        "print(rc, sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split("\n")[0] == "2 []", proc.stdout + proc.stderr[-2000:]
    assert proc.stderr.strip().startswith(f"k2-train: error: {message}"), proc.stderr


def test_help_prints_before_the_heavy_imports():
    """Every tool's ``--help`` returns before torch / megatron-core are imported (they take seconds of CPU
    per process; a user asking for help should not wait for them): one fresh interpreter per tool."""
    import subprocess
    import sys

    tools = [*TOOLS, "convert", "sweep_report", "report"]
    code = (
        "import sys\nfrom importlib import import_module\nrc = import_module(f'k2.launcher.{sys.argv[1]}')"
        ".main(['--help'])\nprint('RESULT', rc, sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))"
    )
    for tool in tools:
        proc = subprocess.run([sys.executable, "-c", code, tool], capture_output=True, text=True, timeout=120)
        assert proc.stdout.splitlines()[-1] == "RESULT 0 []", (tool, proc.stdout[-500:], proc.stderr[-2000:])
