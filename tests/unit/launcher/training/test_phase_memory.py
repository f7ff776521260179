"""Per-phase activation memory: a schedule phase's ``memory.*`` overrides are resolved, planned and
validated up front; ``k2-train`` switches every site at the boundary (no rebuild): a built model switched
to other options saves and computes what one built with them does."""

from __future__ import annotations

import pytest
import torch

from k2.config import ConfigError
from k2.config.load import load_config
from k2.launcher.plan import main
from k2.launcher.training.phase_memory import run_memory_options
from k2.schedules.resolve import resolve_schedule


def test_k2_schedule_turns_layer_recompute_on_for_the_32k_anneal():
    from k2.model.activation_memory import MemoryOptions

    cfg = load_config(["model=kimi_k2"])
    phases = {p.name: p for p in resolve_schedule(cfg).phases}
    base = sorted(cfg.memory.recompute)
    for name in ("warmup", "stable", "decay", "anneal_4k"):
        assert sorted(phases[name].memory["recompute"]) == base and "layer" not in base
    assert sorted(phases["anneal_32k"].memory["recompute"]) == sorted(base + ["layer"])
    assert phases["yarn_128k"].memory == phases["anneal_32k"].memory  # inherited
    assert phases["anneal_32k"].memory["offload"] == list(cfg.memory.offload)  # keys left out: unchanged
    # the model is built with scopes for both settings; yarn_128k (no steps) adds none
    k2 = MemoryOptions.from_config(cfg)
    assert run_memory_options(resolve_schedule(cfg)) == [
        k2,
        MemoryOptions(k2.fp8_store, k2.recompute | {"layer"}, k2.offload),
    ]


@pytest.mark.parametrize(
    "override, named",
    [
        ("schedule.phases.4.memory.recompte=[layer]", "schedule.phases.4.memory.recompte"),
        ("schedule.phases.4.memory.recompute=[attention]", "schedule.phases.4.memory.recompute"),
        ("schedule.phases.4.memory.offload=[attn_input,attn_input]", "schedule.phases.4.memory.offload"),
        ("memory.recompute=[whole_layer]", "memory.recompute"),
    ],
)
def test_bad_phase_memory_is_one_error(capsys, override, named):
    rc = main(["model=kimi_k2", "parallel=k2_256gpu", override])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("k2-plan: error: ") and named in err and err.count("\n") == 1


def test_k2_train_accepts_a_phase_that_changes_any_site(tmp_path):
    """FP8 storage, offload and the op recompute sites switch at a boundary like ``layer``: prepare_run
    (what k2-train checks before any rank starts) accepts a phase that turns them off or on."""
    from k2.launcher.training.prepare import prepare_run

    over = [
        "schedule.phases.2.memory.fp8_store=[swiglu_input]",
        "schedule.phases.2.memory.offload=[core_attn]",
        "schedule.phases.2.memory.recompute=[layernorm,swiglu,mla_up_proj,moe_down_proj]",
        "schedule.phases.3.memory.fp8_store=[]",
        f"run.dir={tmp_path / 'run'}",
    ]
    plan = prepare_run(load_config(over), 1)
    assert [p.memory["fp8_store"] for p in plan.schedule.phases] == [[], [], ["swiglu_input"], [], []]


def test_bad_phase_memory_before_any_rank(tmp_path):
    """A bad site in a phase override stops k2-train's checks with one error naming the phase setting."""
    from k2.launcher.training.prepare import prepare_run

    with pytest.raises(ConfigError, match=r"schedule\.phases\.2\.memory\.fp8_store has 'core_attn'; allowed: "):
        prepare_run(load_config(["schedule.phases.2.memory.fp8_store=[core_attn]", f"run.dir={tmp_path}"]), 1)


SEQ, MBS = 64, 2


def _built(cfg, options, switches=()):
    from k2.model.build import build_model_chunks, layout_independent_init, transformer_config
    from k2.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    tcfg = transformer_config(cfg, dims)  # memory=none: megatron's recompute fields empty
    (model,) = build_model_chunks(cfg, dims, tcfg, options, switches)
    layout_independent_init([model], tcfg, 3)
    return model


def _step(model, cfg):
    """One forward/backward: ``(gradients by name, the meter's bytes per site on device and host)``."""
    from k2.model.saved_bytes_meter import SavedBytesMeter

    tokens = torch.randint(0, cfg.model.vocab_size, (MBS, SEQ), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    model.zero_grad(set_to_none=True)
    meter = SavedBytesMeter()
    with meter.measure():
        loss = model(tokens, pos, None, labels=tokens).float().mean()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, meter.per_forward()


def test_memory_options_switched_on_a_built_model(megatron_world1):
    """One model built with memory=k2's sites (and scopes for the others), switched between steps to
    megatron's layernorm recompute alone, to whole-layer recompute with its input offloaded, and back: each
    step saves per site, on device and on host, the bytes of a model built with those options, with the
    same gradients (bitwise; whole-layer recompute: FP32 rounding of the layernorm-only run's, and only
    the layer inputs kept)."""
    from k2.model.activation_memory import MemoryOptions, set_memory_options

    cfg = load_config(["memory=none"])
    k2 = MemoryOptions.from_sites(load_config(["memory=k2"]).memory)
    norm = MemoryOptions(recompute=frozenset({"layernorm"}))  # megatron's own (recompute_input_layernorm ...)
    layer = MemoryOptions(recompute=frozenset({"layer"}), offload=frozenset({"attn_input"}))
    model = _built(cfg, k2, switches=[norm, layer])
    ref_k2, ref_norm = _step(_built(cfg, k2), cfg), _step(_built(cfg, norm), cfg)
    assert ref_k2[1] != ref_norm[1]  # (the two settings save different bytes)

    def same(got, ref):
        assert got[1] == ref[1]
        assert got[0].keys() == ref[0].keys()
        for n, g in got[0].items():
            assert torch.equal(g, ref[0][n]), n

    same(_step(model, cfg), ref_k2)
    assert set_memory_options([model], norm) == cfg.model.num_layers
    same(_step(model, cfg), ref_norm)
    set_memory_options([model], layer)
    grads, saved = _step(model, cfg)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_norm[0][n], rtol=1e-5, atol=1e-7)
    layer_inputs = cfg.model.num_layers * SEQ * MBS * cfg.model.hidden_size * 4  # FP32 [s, b, h] per layer
    assert saved["host"] == {"attn_input": layer_inputs}
    assert saved["device"].keys() == {"other"}  # outside the layers (embedding, loss)
    set_memory_options([model], k2)
    same(_step(model, cfg), ref_k2)


def test_switching_to_options_without_scopes_is_refused(megatron_world1):
    from k2.model.activation_memory import MemoryOptions, set_memory_options

    cfg = load_config(["memory=none"])
    model = _built(cfg, MemoryOptions())
    with pytest.raises(ValueError, match="no saved-tensor scope"):
        set_memory_options([model], MemoryOptions(fp8_store=frozenset({"swiglu_input"})))


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

    named = re.search(
        r"cluster\.host_memory_gib=0\.001: phase '(\w+)' needs ([0-9.e-]+) GiB .*, "
        r"([0-9.e-]+) GiB available",
        lines[0],
    )
    assert named, lines[0]
    assert float(named[2]) == pytest.approx(need, rel=5e-3) and float(named[3]) == 0.001
    assert named[1] in {row["phase"] for row in plan["phases"]}
    assert no_process_start == [] and not run_dir.exists()
    # enough host memory: prepare_run accepts it (k2-train would start its ranks)
    from k2.launcher.training.prepare import prepare_run

    prepare_run(load_config([*layout, f"cluster.host_memory_gib={need * 1.01}", f"run.dir={run_dir}"]), 4)
