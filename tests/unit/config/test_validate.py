"""The configuration layer's rules (k2.config.validate): every tool applies the same ones with the same
message, each section's check looks at its own section only, the cross-section rules live in one place,
and a removed key says where its setting went."""

from __future__ import annotations

import functools

import pytest
from omegaconf import OmegaConf

from k2.config import ConfigError, load_config
from k2.config import validate as V
from k2.launcher import bench, data, plan, submit, train

#: (overrides, words the one error line must hold): settings that only the config layer can refuse
RULES = {
    "precision": (["train.precision=fp16"], ["train.precision='fp16'", "fp32, bf16"]),
    "keep_last": (["checkpoint.keep_last=0"], ["checkpoint.keep_last=0", "integer >= 1"]),
    "wandb_mode": (["run.wandb.mode=sometimes"], ["run.wandb.mode='sometimes'", "offline, online, disabled"]),
    "cluster_memory": (["cluster.gpu_memory_gib=-1"], ["cluster.gpu_memory_gib=-1", "> 0"]),
    "submit_time": (["submit.time=tomorrow"], ["submit.time='tomorrow'", "HH:MM:SS"]),
    "memory_site": (["memory.offload=[everything]"], ["memory.offload", "everything", "attn_input"]),
    "qk_clip_needs_max_logits": (
        ["optim.qk_clip_tau=100", "model.record_max_logits=false"],
        ["optim.qk_clip_tau=100", "model.record_max_logits=true"],
    ),
    "resume_mode": (["resume.mode=sometimes"], ["resume='sometimes'", "auto, never"]),
    "moved_key": (["plan.split_backward=true"], ["plan.split_backward", "pipeline.decouple_wgrad"]),
}

# each tool: (entry module's main, prog, extra overrides that make the rest of its run valid)
TOOLS = {
    "k2-train": (train.main, "k2-train", []),
    "k2-plan": (plan.main, "k2-plan", ["cluster.gpus_per_node=1"]),
    "k2-submit": (
        submit.main,
        "k2-submit",
        ["submit.dry_run=true", "submit.request_gpus=false", "cluster.gpus_per_node=1"],
    ),
    "k2-bench": (bench.main, "k2-bench", ["bench=attention"]),
    "k2-data": (data.main, "k2-data", []),
    "sweep (k2-train -m)": (train.main, "k2-train", ["-m", "+experiment=sparsity_sweep"]),
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_tool_refuses_the_same_setting_with_the_same_message(tool, rule, tmp_path, capsys, no_process_start):
    main, prog, extra = TOOLS[tool]
    overrides, words = RULES[rule]
    rc = main([*extra, *overrides, f"run.dir={tmp_path / 'run'}", f"sweep.dir={tmp_path / 'sweep'}"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"{prog}: error:")]
    assert rc == 2 and len(lines) == 1, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert lines[0] == f"{prog}: error: {_config_layer_error(rule)}"  # the config layer's own message
    assert no_process_start == [] and not (tmp_path / "run").exists()


@functools.cache
def _config_layer_error(rule: str) -> str:
    """The message ``load_config`` itself raises for ``rule`` (computed once per rule, shared by the tools)."""
    with pytest.raises(ConfigError) as e:
        load_config(RULES[rule][0])
    return str(e.value)


def test_each_section_check_receives_only_its_section():
    cfg = load_config([])
    for name, check in V.SECTION_CHECKS.items():
        check(cfg[name])  # each check takes the section node alone; the defaults pass
    assert set(V.SECTION_CHECKS) <= set(cfg.keys())
    # the typed section cannot hold a value outside run.wandb.mode's Enum: the check gets an untyped copy
    bad_run = OmegaConf.merge(OmegaConf.to_container(cfg.run), {"wandb": {"mode": "x"}})
    with pytest.raises(ConfigError, match="run.wandb.mode"):
        V.check_run(bad_run)


def test_cross_section_rules_in_one_place():
    cfg = load_config([])
    bad = OmegaConf.merge(cfg, {"data": {"vocab_size": 8192}})  # > model.vocab_size 4096
    with pytest.raises(ConfigError, match="data.vocab_size=8192.*model.vocab_size=4096"):
        V.check_cross_section(bad)
    V.check_data(bad.data)  # the data section alone is fine: the rule spans two sections
    sweep_dense = OmegaConf.merge(cfg, {"sweep": {"sparsities": [2]}, "model": {"num_moe_experts": None}})
    with pytest.raises(ConfigError, match="needs a MoE model"):
        V.check_cross_section(sweep_dense)


def test_resume_settings_defaults_and_errors():
    assert V.resume_settings(None) == {"mode": "auto", "from": None, "force": False, "branch_from": None}
    assert V.resume_settings("never")["mode"] == "never"
    with pytest.raises(ConfigError, match="resume=never contradicts resume.from"):
        V.resume_settings({"mode": "never", "from": "/x"})
    with pytest.raises(ConfigError, match="unknown setting resume.frm"):
        V.resume_settings({"frm": 3})
    with pytest.raises(ConfigError, match="resume.branch_from .* contradicts resume=never and resume.from"):
        V.resume_settings({"from": "/x", "branch_from": "/y"})


def test_ep_overlap_runs_in_the_phases_without_whole_layer_recompute():
    """``pipeline.ep_overlap``: K2's schedule recomputes whole layers only in its 32K phase, so the K2 recipe
    with the overlap is valid and the trainer turns the overlap off for that phase alone
    (``PipelineHooks.enter_phase``, read by megatron at every pass); only a schedule in which every
    phase recomputes whole layers is refused."""
    from types import SimpleNamespace

    from k2.config.load import load_config
    from k2.launcher.training.phase_memory import phase_memory_options
    from k2.parallel.dims import ParallelDims
    from k2.schedules.pipeline import PipelineHooks
    from k2.schedules.resolve import resolve_schedule

    cfg = load_config(["model=kimi_k2", "parallel=k2_256gpu", "pipeline.ep_overlap=true"])
    schedule = resolve_schedule(cfg, ParallelDims.from_config(cfg.parallel, cfg.model, 256))
    hooks = PipelineHooks(ep_overlap=True)
    hooks.tcfg = SimpleNamespace(overlap_moe_expert_parallel_comm=True)
    on = {p.name: hooks.enter_phase(phase_memory_options(p)) for p in schedule.phases}
    assert on == {
        "warmup": True,
        "stable": True,
        "decay": True,
        "anneal_4k": True,
        "anneal_32k": False,
        "yarn_128k": False,
    }
    assert hooks.tcfg.overlap_moe_expert_parallel_comm is False  # the last phase entered
    hooks.enter_phase(phase_memory_options(schedule.phases[0]))
    assert hooks.tcfg.overlap_moe_expert_parallel_comm is True
    assert not PipelineHooks(ep_overlap=False).overlaps_in(phase_memory_options(schedule.phases[0]))
    # every phase with whole-layer recompute: nothing would overlap
    with pytest.raises(ConfigError, match=r"memory.recompute containing 'layer'"):
        load_config(
            [
                "model=kimi_k2",
                "parallel=k2_256gpu",
                "pipeline.ep_overlap=true",
                "memory.recompute=[layer]",
                "schedule.phases.4.memory.recompute=[layer]",
            ]
        )
