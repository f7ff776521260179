"""The activation planner (launcher/planning/stage_activations.py ``stage_activations`` over
launcher/planning/activation_bytes.py, the pipeline simulator's peak in flight) against the saved-tensor
meter on cpu4: PP2 x VPP2 (interleaved 1F1B), EP2, DP2, over the memory settings none, FP8 storage, selective
(op) recompute, whole-layer recompute, offload and memory=k2, each at 2 x 128 tokens (FP32) and at 1 x 256
(BF16).

One launch measures every case (tests/support/scripts/measure_saved_bytes.py: the trainer's model, DDP
and megatron's schedule, rebuilt per case in one process group). Per PP rank (the mean of its two EP
ranks, whose routed-token counts sum to the planner's expected ``2 x T x top-k``):

* each model chunk's bytes per microbatch on the device and on the host: within 10% of the planner's
  (CPU kernels);
* the peak of the saved bytes alive at once over the schedule, on the device and on the host: within 10%
  of the planner's simulated peak in flight (``PipelineResult.peak_activation_bytes`` / ``peak_bytes``).
  Nothing is allowed for past the plan's window (end of forward to end of backward): with whole-layer
  recompute a stage keeps only its layers' inputs, and one input held past its backward (as megatron's
  token dispatcher did through its router probabilities, model/recompute.py
  ``K2TransformerLayer._release_dispatch_probs``) is 20% on PP rank 0. Before the window, with the layer
  input offloaded (``attn_input``): the meter samples at a layer scope's commit, while the forward in
  progress still holds that layer's input ``[s, b, h]`` on the device (moved to host, not yet freed by its
  caller); up to one such input is allowed;
* what each setting saves against memory=none (device bytes dropped, host bytes added, summed over the
  stages): within 10% of the planner's difference, so a planner that ignored a setting fails.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from k2.config.load import load_config
from k2.launcher.planning.analysis import stage_costs
from k2.launcher.planning.pipeline_sim import simulate
from k2.launcher.planning.stage_activations import stage_activations
from k2.model.flops import flops_per_token
from k2.parallel.dims import ParallelDims
from support import REPO, SCRIPTS

pytestmark = pytest.mark.slow

OFFLOAD_ALL = (
    "memory.offload=[attn_input,mla_up_proj,core_attn,attn_proj,mlp_input,moe_fc1_input,swiglu_input,fc2_input]"
)
SETTINGS = {
    "none": ["memory=none"],
    "fp8": ["memory.fp8_store=[moe_fc1_input,swiglu_input]"],
    "op_recompute": ["memory.recompute=[layernorm,swiglu,mla_up_proj,moe_down_proj]"],
    "layer_recompute": ["memory.recompute=[layer]"],
    "offload": [OFFLOAD_ALL],
    "k2": ["memory=k2"],
}
SHAPES = {"fp32-2x128": ([], 128, 2), "bf16-1x256": (["train.precision=bf16"], 256, 1)}
MICROBATCHES = 4  # per DP rank: interleaved 1F1B over 2 PP ranks x 2 chunks
BASE = ["parallel=cpu4"]


#: the settings measured at each shape: all of them at both (the single-rank test of
#: tests/unit/launcher/planning/test_memory_plan.py runs every switch alone at both shapes)
SHAPE_SETTINGS = {shape: tuple(SETTINGS) for shape in SHAPES}


def _cases():
    return [
        [f"{s}/{shape}", [*SETTINGS[s], *extra], seq, mbs, MICROBATCHES]
        for shape, (extra, seq, mbs) in SHAPES.items()
        for s in SHAPE_SETTINGS[shape]
    ]


@pytest.fixture(scope="module")
def measured(tmp_path_factory, stdlib_corpus):
    """``{case: {pp_rank: figures averaged over the PP rank's ranks}}`` from one cpu4 launch."""
    from support.distributed import rank_launch_cmd, trainer_env
    from support.zygote import PRECOMPOSE_ENV

    out = tmp_path_factory.mktemp("saved_bytes")
    args = [*BASE, "run.wandb.mode=disabled", f"run.dir={out / 'run'}"]
    cmd = rank_launch_cmd(4, [str(SCRIPTS / "measure_saved_bytes.py")], args)
    cases = _cases()
    # (each rank composes every case's config: under the fork server, once before the fork instead)
    precompose = json.dumps([[*args, *overrides] for _, overrides, *_ in cases])
    env = trainer_env({"K2_TEST_OUT": str(out), "K2_MEASURE_CASES": json.dumps(cases), PRECOMPOSE_ENV: precompose})
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = [json.loads((out / f"saved_rank{r}.json").read_text()) for r in range(4)]
    result = {}
    for name in ranks[0]["cases"]:
        by_pp: dict = {}
        for rank in ranks:
            fig = rank["cases"][name]
            by_pp.setdefault(fig["pp_rank"], []).append(fig)
        result[name] = {}
        for pp_rank, figs in by_pp.items():
            mean = lambda key, figs=figs: sum(f[key] for f in figs) / len(figs)  # noqa: E731
            chunks = len(figs[0]["per_chunk_device"])
            result[name][pp_rank] = {
                "per_chunk_device": [sum(f["per_chunk_device"][v] for f in figs) / len(figs) for v in range(chunks)],
                "per_chunk_host": [sum(f["per_chunk_host"][v] for f in figs) / len(figs) for v in range(chunks)],
                "peak_device": mean("peak_device"),
                "peak_host": mean("peak_host"),
            }
    return result


def predicted(overrides: list[str], seq: int, mbs: int) -> dict:
    """The planner's figures for the same case: per PP rank its chunks' bytes per microbatch (CPU kernels)
    and the simulated peak in flight of megatron's schedule."""
    cfg = load_config([*BASE, *overrides])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 4)
    in_forward = (
        ("attn_input" in (cfg.memory.offload or ()))
        * seq
        * mbs
        * int(cfg.model.hidden_size)
        * (2 if cfg.train.precision == "bf16" else 4)
    )
    acts = stage_activations(
        cfg.model,
        dims,
        seq_length=seq,
        micro_batch_size=mbs,
        precision=cfg.train.precision,
        memory_cfg=cfg.memory,
        fused_kernels=False,
    )
    F, B, W = stage_costs(flops_per_token(cfg.model, seq), dims, seq * mbs, 1.0, list(cfg.memory.recompute or ()))
    sim = simulate(dims.pp, dims.vpp, MICROBATCHES, F, B, W, activation_bytes=[a.gpu for a in acts])
    host_peak = sim.peak_bytes([a.host for a in acts])
    return {
        r: {
            "per_chunk_device": [acts[v * dims.pp + r].gpu for v in range(dims.vpp)],
            "per_chunk_host": [acts[v * dims.pp + r].host for v in range(dims.vpp)],
            "peak_device": sim.peak_activation_bytes[r],
            "peak_host": host_peak[r],
            "in_forward": in_forward,
        }
        for r in range(dims.pp)
    }


def _close(p: float, m: float, early: float = 0.0) -> bool:
    """``p`` within 10% of ``m`` (or 1 KiB), or (``early``) of ``m`` less up to ``early`` bytes held by the
    forward in progress."""
    return p == pytest.approx(m, rel=0.10, abs=1024) or (m > p and p == pytest.approx(max(p, m - early), rel=0.10))


@pytest.mark.parametrize("shape", SHAPES)
def test_planner_matches_measured_saved_bytes_on_cpu4(measured, shape):
    extra, seq, mbs = SHAPES[shape]
    bad = []
    plans = {s: predicted([*SETTINGS[s], *extra], seq, mbs) for s in SHAPE_SETTINGS[shape]}
    for s in SHAPE_SETTINGS[shape]:
        got, plan = measured[f"{s}/{shape}"], plans[s]
        for r in plan:
            if not _close(plan[r]["peak_device"], got[r]["peak_device"], plan[r]["in_forward"]):
                bad.append((s, r, "peak_device", plan[r]["peak_device"], got[r]["peak_device"]))
            if not _close(plan[r]["peak_host"], got[r]["peak_host"]):
                bad.append((s, r, "peak_host", plan[r]["peak_host"], got[r]["peak_host"]))
            for key in ("per_chunk_device", "per_chunk_host"):
                for v, (p, m) in enumerate(zip(plan[r][key], got[r][key], strict=True)):
                    if not _close(p, m):
                        bad.append((s, r, f"{key}[{v}]", p, m))
    assert not bad, bad
    # what each setting changes against memory=none, summed over the stages: device bytes dropped, host
    # bytes added per microbatch (a planner that ignored a setting predicts 0 here)
    total = lambda figs, key: sum(sum(f[key]) for f in figs.values())  # noqa: E731
    none_m, none_p = measured[f"none/{shape}"], plans["none"]
    for s in SHAPE_SETTINGS[shape]:
        if s == "none":
            continue
        got = measured[f"{s}/{shape}"]
        dropped_m = total(none_m, "per_chunk_device") - total(got, "per_chunk_device")
        dropped_p = total(none_p, "per_chunk_device") - total(plans[s], "per_chunk_device")
        assert dropped_m > 0 and dropped_p == pytest.approx(dropped_m, rel=0.10), (s, dropped_p, dropped_m)
        host_m, host_p = total(got, "per_chunk_host"), total(plans[s], "per_chunk_host")
        assert host_p == pytest.approx(host_m, rel=0.10, abs=1024), (s, host_p, host_m)
