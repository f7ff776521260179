"""Per-phase activation memory: a schedule phase's ``memory.*`` overrides are resolved, planned and
validated up front; ``k2-train`` switches whole-layer recompute at the boundary (no rebuild) and refuses the
changes it cannot make."""

from __future__ import annotations

import pytest
import torch

from k2.config import ConfigError
from k2.config.load import load_config
from k2.launcher.plan import main
from k2.launcher.training.phase_memory import check_phase_memory_switches
from k2.schedules.resolve import resolve_schedule


def test_k2_schedule_turns_layer_recompute_on_for_the_32k_anneal():
    cfg = load_config(["model=kimi_k2"])
    phases = {p.name: p for p in resolve_schedule(cfg).phases}
    base = sorted(cfg.memory.recompute)
    for name in ("warmup", "stable", "decay", "anneal_4k"):
        assert sorted(phases[name].memory["recompute"]) == base and "layer" not in base
    assert sorted(phases["anneal_32k"].memory["recompute"]) == sorted(base + ["layer"])
    assert phases["yarn_128k"].memory == phases["anneal_32k"].memory  # inherited
    assert phases["anneal_32k"].memory["offload"] == list(cfg.memory.offload)  # keys left out: unchanged
    check_phase_memory_switches(resolve_schedule(cfg), cfg.memory)  # k2-train can run it


@pytest.mark.parametrize("override, named", [
    ("schedule.phases.4.memory.recompte=[layer]", "schedule.phases.4.memory.recompte"),
    ("schedule.phases.4.memory.recompute=[attention]", "schedule.phases.4.memory.recompute"),
    ("schedule.phases.4.memory.offload=[attn_input,attn_input]", "schedule.phases.4.memory.offload"),
    ("memory.recompute=[whole_layer]", "memory.recompute"),
])
def test_bad_phase_memory_is_one_error(capsys, override, named):
    rc = main(["model=kimi_k2", "parallel=k2_256gpu", override])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("k2-plan: error: ") and named in err and err.count("\n") == 1


def test_k2_train_refuses_a_phase_change_it_cannot_switch():
    cfg = load_config(["model=kimi_k2", "schedule.phases.4.memory.fp8_store=[]"])
    with pytest.raises(ConfigError, match=r"schedule\.phases\.4\.memory\.fp8_store=\[\] \(phase 'anneal_32k'\)"):
        check_phase_memory_switches(resolve_schedule(cfg), cfg.memory)


def test_layer_recompute_switched_on_a_built_model(megatron_world1):
    """The switch between two steps of one built model: gradients equal to the run without it (FP32
    rounding), saved bytes per microbatch down to the layer inputs."""
    from k2.model.activation_memory import MemoryOptions, set_layer_recompute
    from k2.model.build import build_model_chunks, layout_independent_init, transformer_config
    from k2.model.saved_bytes_meter import SavedBytesMeter
    from k2.parallel.dims import ParallelDims

    cfg = load_config(["memory=none"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    tcfg = transformer_config(cfg, dims)
    (model,) = build_model_chunks(cfg, dims, tcfg, MemoryOptions.from_config(cfg))
    layout_independent_init([model], tcfg, 3)
    seq, mbs = 64, 2
    tokens = torch.randint(0, cfg.model.vocab_size, (mbs, seq), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(seq).unsqueeze(0).expand(mbs, seq)

    def step():
        model.zero_grad(set_to_none=True)
        meter = SavedBytesMeter()
        with meter.measure():
            loss = model(tokens, pos, None, labels=tokens).float().mean()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, meter.per_forward()

    plain, plain_bytes = step()
    assert set_layer_recompute([model], True) == cfg.model.num_layers
    switched, switched_bytes = step()
    assert plain.keys() == switched.keys()
    for n, g in switched.items():
        torch.testing.assert_close(g, plain[n], rtol=1e-5, atol=1e-7)
    layer_inputs = cfg.model.num_layers * seq * mbs * cfg.model.hidden_size * 4
    # outside the layers (embedding, loss) the same; inside only the inputs
    assert switched_bytes["device_total"] < 0.5 * plain_bytes["device_total"]
    assert switched_bytes["device_total"] >= layer_inputs


def test_k2_train_refuses_host_memory_too_small(tmp_path, capsys, no_process_start):
    """memory=k2 offloads activations to host memory: with cluster.host_memory_gib below what the plan needs
    per node, k2-train stops with one error naming the setting, the GiB needed (k2-plan's own figure for the
    fullest phase) and the GiB available, before any process group or rank starts; k2-plan keeps reporting
    the layout as not fitting (host). With the figure above the need, the check passes."""
    import json

    from k2.launcher.train import main as train_main

    layout = ["parallel=cpu4", "memory=k2", "cluster.nodes=1", "cluster.gpus_per_node=4"]
    assert main([*layout, "cluster.host_memory_gib=0.001", "output=json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    need = max(row["host_bytes_per_node"] for row in plan["phases"]) / 2**30
    assert 0.001 < need < 1 and plan["fits"] is False
    assert {row["fits_host"] for row in plan["phases"]} == {False}
    run_dir = tmp_path / "run"
    rc = train_main([*layout, "cluster.host_memory_gib=0.001", f"run.dir={run_dir}", "run.wandb.mode=disabled"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("k2-train: error:")]
    assert rc == 2 and len(lines) == 1, err
    import re

    named = re.search(r"cluster\.host_memory_gib=0\.001: phase '(\w+)' needs ([0-9.e-]+) GiB .*, ([0-9.e-]+) GiB available",
                      lines[0])
    assert named, lines[0]
    assert float(named[2]) == pytest.approx(need, rel=5e-3) and float(named[3]) == 0.001
    assert named[1] in {row["phase"] for row in plan["phases"]}
    assert no_process_start == [] and not run_dir.exists()
    # enough host memory: prepare_run accepts it (k2-train would start its ranks)
    from k2.launcher.training.prepare import prepare_run

    prepare_run(load_config([*layout, f"cluster.host_memory_gib={need * 1.01}", f"run.dir={run_dir}"]), 4)
