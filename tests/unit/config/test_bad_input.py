"""Bad input fails fast with one clear message naming the setting, before any process group starts.
Each case runs k2-train's real entry point in-process: it must return 2, print one
``k2-train: error:`` line naming the setting, start no process group and create no run directory."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from k2.launcher.train import main

CASES = {
    "world_not_divisible_by_pp": (["parallel=cpu4", "parallel.pp=3"], ["parallel.pp=3", "world size 4"]),
    "layers_not_divisible_over_pp_vpp": (["parallel=cpu4", "model.num_layers=5"], ["model.num_layers", "5"]),
    "first_last_overrides_leave_remainder": (
        ["parallel=pp2", "parallel.first_stage_layers=3", "parallel.last_stage_layers=2", "model.num_layers=4"],
        ["first_stage_layers"],
    ),
    "too_few_microbatches_for_interleaving": (
        ["parallel=cpu4", "schedule.global_batch_tokens=512", "train.micro_batch_size=2"],
        ["microbatch", "parallel.pp"],
    ),
    "experts_not_divisible_by_ep": (
        ["parallel=cpu4", "model.num_moe_experts=6", "parallel.ep=4", "launch.nproc_per_node=8"],
        ["model.num_moe_experts=6", "parallel.ep=4"],
    ),
    "ep_not_dividing_dp": (["parallel=cpu4", "parallel.ep=4"], ["parallel.ep=4"]),
    "unknown_key": (["model.num_layrs=3"], ["model.num_layrs", "model.num_layers"]),
    # zero validation batches recorded val_loss 0.0, which a sweep took for a measurement
    "no_validation_batches": (["train.eval_iters=0"], ["train.eval_iters=0", "train.eval_interval=0"]),
    "negative_eval_interval": (["train.eval_interval=-5"], ["train.eval_interval=-5", ">= 0"]),
    "unknown_recipe": (["parallel=cpu5"], ["parallel/cpu5", "cpu4"]),
    "schedule_phases_out_of_order": (
        ["schedule.phases.2.until_tokens=300000"],
        ["schedule.phases.2.until_tokens", "out of order"],
    ),
    "schedule_context_beyond_positions": (
        ["model.max_position_embeddings=256"],
        ["schedule.phases.4.seq_length=512", "model.max_position_embeddings=256"],
    ),
    "schedule_batch_tokens_not_divisible": (
        ["schedule.global_batch_tokens=2000"],
        ["schedule.global_batch_tokens=2,000", "seq_length=128"],
    ),
    "schedule_long_phase_microbatches": (
        ["parallel=cpu4", "schedule.phases.4.micro_batch_size=2"],
        ["schedule.phases.4", "microbatch", "parallel.pp"],
    ),
    "pipeline_trace_is_a_file": (
        [f"pipeline.trace={Path(__file__).resolve()}"],
        ["pipeline.trace", "is a file", "directory"],
    ),
    "pipeline_decouple_wgrad_not_bool": (["pipeline.decouple_wgrad=maybe"], ["pipeline.decouple_wgrad"]),
    "ep_overlap_without_ep": (
        ["parallel=pp2", "pipeline.ep_overlap=true"],
        ["pipeline.ep_overlap=true", "parallel.ep=1", "parallel.ep >= 2"],
    ),
    "ep_overlap_pp_without_vpp": (
        ["parallel=cpu4", "parallel.vpp=1", "pipeline.ep_overlap=true"],
        ["pipeline.ep_overlap=true", "parallel.pp=2", "parallel.vpp >= 2"],
    ),
    "ep_overlap_dense_model": (
        ["parallel=cpu4", "model.num_moe_experts=null", "pipeline.ep_overlap=true"],
        ["pipeline.ep_overlap=true", "no experts"],
    ),
    "ep_overlap_whole_layer_recompute": (
        ["parallel=cpu4", "memory.recompute=[layer]", "pipeline.ep_overlap=true"],
        ["pipeline.ep_overlap=true", "memory.recompute", "'layer'", "re-runs", "all-to-all"],
    ),
    "memory_unknown_fp8_site": (
        ["memory.fp8_store=[moe_fc2_input]"],
        ["memory.fp8_store", "moe_fc2_input", "moe_fc1_input, swiglu_input"],
    ),
    "memory_unknown_recompute_site": (
        ["memory.recompute=[core_attn]"],
        ["memory.recompute", "core_attn", "moe_down_proj"],
    ),
    "memory_unknown_offload_site": (["memory.offload=[everything]"], ["memory.offload", "attn_input"]),
    "attention_backend_unknown": (["model.attention_backend=flash"], ["model.attention_backend", "flash", "sdpa"]),
    "max_logit_kernel_unknown": (["model.max_logit_kernel=cuda"], ["model.max_logit_kernel", "torch, triton"]),
    "grouped_gemm_unaligned_width": (
        ["model.moe_grouped_gemm=true", "model.moe_ffn_hidden_size=60"],
        ["model.moe_grouped_gemm=true", "model.moe_ffn_hidden_size", "60", "multiple of 8"],
    ),
    "grouped_gemm_with_tp": (
        ["model.moe_grouped_gemm=true", "parallel.tp=2", "launch.nproc_per_node=2"],
        ["model.moe_grouped_gemm=true", "parallel.tp=2"],
    ),
    "option_style": (["--parallel", "cpu4"], ["'--parallel' is not an override", "write parallel=cpu4"]),
    "option_style_equals": (["--train.iters=3"], ["write train.iters=3"]),
    "missing_dataset": (
        ["data.path=/nonexistent/corpus_text_document", "data.tokenizer=/nonexistent/t.json"],
        ["data.path", "/nonexistent/corpus_text_document"],
    ),
}

try:  # (only where it is bad input: no Transformer Engine or no CUDA)
    import torch as _torch

    from k2.model.backends import te_available as _te

    _TE_HERE = _torch.cuda.is_available() and _te()
except Exception:
    _TE_HERE = False
if not _TE_HERE:
    CASES["max_logit_kernel_triton_without_cuda"] = (
        ["model.max_logit_kernel=triton"],
        ["model.max_logit_kernel=triton", "CUDA"],
    )
    CASES["attention_backend_te_without_te"] = (
        ["model.attention_backend=te"],
        ["model.attention_backend=te", "Transformer Engine"],
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_fails_fast_naming_the_setting(name, tmp_path, capsys, no_process_start):
    overrides, must_name = CASES[name]
    started = no_process_start
    run_dir = tmp_path / "run"
    t0 = time.perf_counter()
    rc = main([*overrides, f"run.dir={run_dir}", "run.wandb.mode=disabled"])
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("k2-train: error:")]
    assert len(lines) == 1, err
    for word in must_name:
        assert word in lines[0], (word, lines[0])
    assert started == []  # no process group, no rank, no training started
    assert not run_dir.exists()
    assert elapsed < 60


def test_tokenizer_vocab_larger_than_model(tmp_path, capsys, stdlib_corpus):
    rc = main(["model.vocab_size=1000", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "model.vocab_size" in err and "1000" in err and "4096" in err, err


def test_run_dir_whose_latest_names_a_missing_checkpoint_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("iter_0000004\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    rc = main([f"run.dir={run_dir}", "run.wandb.mode=disabled"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "checkpoints/latest names iter_0000004, which does not exist" in err and "delete" in err, err
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched
