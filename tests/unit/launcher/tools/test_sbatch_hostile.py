"""The rendered batch script against hostile settings: a newline, ``$(...)``, backticks, quotes and an
``#SBATCH`` line in EVERY string setting of the schema (found by walking :class:`k2.config.schema.K2Config`,
so a setting added later is covered too). Each value is either refused in one line naming the setting,
or written so that the script, run with ``srun`` / ``scontrol`` / the interpreter stubbed, runs nothing but
the launcher's own commands (which receive the value unchanged) and its ``#SBATCH`` block is exactly k2's
lines plus the allowed extra, all before the first command (sbatch reads directives only up to there).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import subprocess
import types
import typing
from pathlib import Path

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

from k2.config import ConfigError
from k2.config.load import load_config
from k2.config.schema import K2Config
from k2.config.validate import validate
from k2.launcher.tools.sbatch import check_submittable, render_sbatch, train_overrides

#: separators of the stubs' call log (no hostile value holds them)
_ARG, _CALL = "\x1f", "\x1e"
#: a one-node CPU job with an allowed extra #SBATCH option
BASE = [
    "cluster.nodes=1",
    "cluster.gpus_per_node=1",
    "submit.request_gpus=false",
    "submit.extra_args=['--mail-type=END']",
]


def _hostile(marks: Path) -> str:
    """A value with a newline, an #SBATCH line, $(...), backticks, both quotes and a ;-separated command,
    each of which creates a file under ``marks`` if the shell runs it."""
    return (
        f"v\n#SBATCH --uid=0\ntouch {marks}/newline\n#$(touch {marks}/dollar)`touch {marks}/backtick`"
        f"'\"; touch {marks}/semicolon #\r\x0bend"
    )


def _string_settings(cls=K2Config, prefix: str = "") -> list[tuple[str, str]]:
    """``(dotted key, kind)`` of every setting that holds a string: ``str``, ``List[str]``, ``Any`` (a
    path or a list of paths), the string keys of a mapping (``resume``); the first item of a list of
    sections (``schedule.phases.0.*``)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t, key = hints[f.name], prefix + f.name
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if typing.get_origin(t) in (typing.Union, types.UnionType) and len(args) == 1:  # Optional[X], X | None
            t = args[0]
        origin, args = typing.get_origin(t), typing.get_args(t)
        if dataclasses.is_dataclass(t):
            out += _string_settings(t, key + ".")
        elif origin is list and args and dataclasses.is_dataclass(args[0]):
            out += _string_settings(args[0], key + ".0.")
        elif origin is list and args == (str,):
            out.append((key, "list"))
        elif origin is dict and args[0] is str and args[1] is str:
            out.append((key, "dict"))
        elif origin is dict:  # a plain mapping with defaults: its keys that default to a string or null
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else {}
            out += [(f"{key}.{k}", "str") for k, v in default.items() if v is None or isinstance(v, str)]
        elif t is str or t is typing.Any:
            out.append((key, "str"))
    return out


def _override(key: str, kind: str, value: str) -> str:
    quoted = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"  # Hydra's quoted string
    return {"str": f"{key}={quoted}", "list": f"{key}=[{quoted}]", "dict": f"+{key}.K2_HOSTILE={quoted}"}[kind]


@contextlib.contextmanager
def _setting(cfg, key: str, value):
    """``cfg`` (writable) with ``key`` set to ``value`` and validated as :func:`load_config` validates it,
    the old value put back afterwards (composing with Hydra for every setting would cost ~0.3 CPU-s
    each; Hydra's reading of the override is checked once)."""
    old = OmegaConf.select(cfg, key)
    old = OmegaConf.to_container(old) if isinstance(old, (DictConfig, ListConfig)) else old
    try:
        OmegaConf.update(cfg, key, value, merge=False)
        validate(cfg)
        yield cfg
    finally:
        OmegaConf.update(cfg, key, old, merge=False)


def _stub(bin_dir: Path, name: str, log: Path) -> Path:
    f = bin_dir / name
    f.write_text(
        f"#!/bin/bash\n{{ printf '%s' {name}; for a in \"$@\"; do printf '{_ARG}%s' \"$a\"; done; "
        f"printf '{_CALL}'; }} >> {log}\n"
        + ('[ "$1" = show ] && echo nodeX\n' if name == "scontrol" else "")
        + "exit 0\n"
    )
    f.chmod(0o755)
    return f


def _directives(text: str) -> list[str]:
    """The #SBATCH lines sbatch reads: those before the first line that is neither blank nor a comment."""
    out = []
    for line in text.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            out.append(line)
    return out


def _run(text: str, tmp: Path) -> list[list[str]]:
    """Run the script with srun, scontrol and the interpreter stubbed; the calls they received."""
    bin_dir, log = tmp / "bin", tmp / "calls"
    log.write_text("")
    script = tmp / "pretrain.sbatch"
    script.write_text(text)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "K2_WORKDIR": str(tmp),
        "SLURM_JOB_ID": "10001",
        "SLURM_JOB_NODELIST": "nodeX",
        "SLURM_JOB_NUM_NODES": "1",
    }
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return [c.split(_ARG) for c in log.read_bytes().decode().split(_CALL) if c]


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol", "python"):
        _stub(bin_dir, name, tmp_path / "calls")
    return tmp_path


def test_every_string_setting_is_found():
    keys = dict(_string_settings())
    for key in (
        "prepare.text_key",
        "data.cache_dir",
        "data.split",
        "schedule.phases.0.name",
        "run.dir",
        "submit.partition",
        "submit.extra_args",
        "resume.from",
        "run.wandb.name",
        "data.path",
    ):
        assert key in keys, key
    assert len(keys) > 60


def test_hostile_values_in_every_string_setting_run_nothing_but_the_launcher(stubs, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    value = _hostile(marks)
    python = str(stubs / "bin" / "python")
    base = [*BASE, f"run.dir={tmp_path}/run", f"submit.python={python}"]
    base_text = render_sbatch(load_config(base), base)
    k2_lines = _directives(base_text)
    for want in (
        "--requeue",
        "--time=",
        "--exclusive",
        "--signal=USR1@",
        f"--output={tmp_path}/run/",
        "--mail-type=END",
    ):
        assert any(line.startswith(f"#SBATCH {want}") for line in k2_lines), (want, k2_lines)
    # Hydra reads the override as written to exactly the value (the ranks parse the same string)
    assert load_config([*base, _override("prepare.text_key", "str", value)]).prepare.text_key == value
    cfg = copy.deepcopy(load_config(base))  # one writable copy, each setting set and put back in turn
    OmegaConf.set_readonly(cfg, False)
    rendered, refused = [], []
    for key, kind in _string_settings():
        ov = _override(key, kind, value)
        overrides = [*base, ov]
        try:
            with _setting(cfg, key, {"str": value, "list": [value], "dict": {"K2_HOSTILE": value}}[kind]):
                check_submittable(cfg)
                text = render_sbatch(cfg, overrides)
                args = train_overrides(cfg, overrides)
        except ConfigError as e:  # refused: one line naming the setting
            msg, parent, last = str(e), key.rsplit(".", 1)[0], key.rsplit(".", 1)[-1]
            assert "\n" not in msg and (last in msg or f"{parent}=" in msg), (key, msg)
            refused.append(key)
            continue
        rendered.append(key)
        assert _directives(text) == k2_lines, (key, _directives(text))
        assert sum(line.startswith("#SBATCH") for line in text.splitlines()) == len(k2_lines), key
        calls = _run(text, tmp_path)
        assert not list(marks.iterdir()), (key, list(marks.iterdir()))
        train = [c for c in calls if c[0] == "srun" and "k2.launcher.train" in c]
        assert len(train) == 1, (key, calls)
        assert train[0][train[0].index("k2.launcher.train") + 1 :] == args, key
        for call in calls:  # nothing else: the corpus build and the node list
            assert (
                call[:3] == ["python", "-m", "k2.launcher.data"] or call[:2] == ["scontrol", "show"] or call is train[0]
            ), (key, call)
    # the settings a value reaches the trainer through (not refused): the ones the issue named among them
    assert {"prepare.text_key", "data.cache_dir", "data.split", "schedule.phases.0.name"} <= set(rendered), refused
    assert {"submit.partition", "submit.extra_args", "run.dir"} <= set(refused), rendered
