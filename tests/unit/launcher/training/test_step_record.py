"""One optimizer step's record of ``metrics.jsonl`` (k2.launcher.training.metrics.step_record): the keys in
the order the trainer wrote them (the main job's records, key for key), each value from its input, and the
optional keys only where they apply."""

from __future__ import annotations

from types import SimpleNamespace

from k2.launcher.training.metrics import step_record

# the keys of a step's record in the main job's metrics.jsonl (`k2-train parallel=cpu4`), up to the fields
# the spike guard and the goodput clock add after it
MAIN_JOB_KEYS = [
    "step",
    "consumed_tokens",
    "phase",
    "seq_length",
    "global_batch_size",
    "num_microbatches",
    "layer_recompute",
    "lr",
    "loss",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "update_successful",
    "max_attn_logit",
    "max_attn_logit_per_layer",
    "qk_clipped_heads",
    "model_tflops_per_gpu",
    "mfu",
    "moe_load_max_over_mean",
    "moe_routed_tokens",
    "moe_aux_loss",
]


def _phase(**memory):
    return SimpleNamespace(name="stable", seq_length=128, global_batch_size=16, num_microbatches=4, memory=memory)


def _record(**kwargs):
    attn = {"max_attn_logit": 12.5, "max_attn_logit_per_layer": [12.5, 3.0], "qk_clipped_heads": 0}
    moe = {"moe_load_max_over_mean": 1.5, "moe_routed_tokens": 4096, "moe_aux_loss": 0.01}
    args = {
        "consumed_tokens": 14336,
        "lr": 3e-3,
        "loss": 5.25,
        "grad_norm": 0.5,
        "update_ok": True,
        "seconds": 0.5,
        "tokens_per_step": 2048,
        "attn": attn,
        "mfu": (0.02, None),
        "extra": [moe, {}],
        **kwargs,
    }
    return step_record(7, _phase(), **args)


def test_the_record_has_the_main_job_s_keys_in_order_and_each_value_from_its_input():
    rec = _record()
    assert list(rec) == MAIN_JOB_KEYS
    assert rec["tokens_per_s"] == 4096.0 and rec["step_time_s"] == 0.5 and rec["consumed_tokens"] == 14336
    phase = (rec["phase"], rec["seq_length"], rec["global_batch_size"], rec["num_microbatches"])
    assert phase == ("stable", 128, 16, 4)
    assert rec["layer_recompute"] is False and rec["update_successful"] is True
    assert (rec["model_tflops_per_gpu"], rec["mfu"]) == (0.02, None) and rec["moe_routed_tokens"] == 4096


def test_optional_keys_only_where_they_apply():
    rec = _record(
        grad_norm=None, saved_bytes_per_microbatch=1024.0, replayed=True, extra=[{"wgrad_deferred_peak_bytes": 7}]
    )
    assert rec["grad_norm"] is None and rec["saved_bytes_per_microbatch"] == 1024.0 and rec["replayed"] is True
    assert list(rec)[-3:] == ["wgrad_deferred_peak_bytes", "saved_bytes_per_microbatch", "replayed"]
    assert step_record(
        7,
        _phase(recompute=["layer"]),
        consumed_tokens=0,
        lr=0.0,
        loss=1.0,
        grad_norm=1,
        update_ok=False,
        seconds=1.0,
        tokens_per_step=1,
        attn={},
        mfu=(0.0, 0.0),
    )["layer_recompute"]
