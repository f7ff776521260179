"""Measure what autograd keeps for backward in the trainer's pipeline schedule, for several memory settings
in one launch, and write this rank's figures to $K2_TEST_OUT/saved_rank<R>.json.

The cases come from $K2_MEASURE_CASES, a JSON list of ``[name, overrides, seq_length, micro_batch_size,
num_microbatches]``; each is built as ``k2-train`` builds its model (``transformer_config``,
``build_model_chunks`` with the case's ``memory.*`` hooks, DDP) in the one process group of the launch,
and runs one forward-backward over ``num_microbatches`` random microbatches through megatron's schedule
(interleaved 1F1B with ``parallel.vpp > 1``, ``forward_step`` of ``k2-train``) inside a
:class:`k2.model.saved_tensors.SavedBytesMeter`. Each model chunk's forward runs in a saved-tensor scope
of its own, so that what the embedding and loss stages save outside the transformer layers is counted.

Per case, this rank writes:

* ``per_chunk_device`` / ``per_chunk_host``: per model chunk (``vpp`` of them), the saved bytes one
  microbatch's forward leaves alive on the device / on the host at its end (the storages the meter took
  during the chunk's forward, averaged over the microbatches);
* ``peak_device`` / ``peak_host``: the most saved bytes alive at once over the schedule (the peak in
  flight);
* ``pp_rank``.

Used by tests/integration/test_activation_plan_measured.py (cpu4, through ``run_trainer``) and, in
process with a one-rank megatron world, by tests/unit/launcher/planning/test_memory_plan.py (:func:`measure`).
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch


def _microbatches(vocab: int, seq_length: int, micro_batch_size: int, n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (micro_batch_size, seq_length + 1), generator=gen)
        out.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(micro_batch_size, seq_length),
                "position_ids": torch.arange(seq_length).expand(micro_batch_size, seq_length).contiguous(),
            }
        )
    return out


def measure(cfg, dims, seq_length: int, micro_batch_size: int, num_microbatches: int) -> dict:
    """One forward-backward of ``cfg``'s model (built here) over ``num_microbatches`` microbatches in the
    current megatron world; this rank's saved bytes (module docstring)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from k2.launcher.training.step import forward_step
    from k2.model.build import build_model_chunks, transformer_config
    from k2.model.saved_bytes_meter import SavedBytesMeter
    from k2.model.saved_tensors import SavedTensorScope
    from k2.parallel.distributed import wrap_model

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    tcfg = transformer_config(cfg, dims)
    chunks = build_model_chunks(cfg, dims, tcfg)
    model = wrap_model(chunks, tcfg, bool(cfg.parallel.use_distributed_optimizer))
    meter = SavedBytesMeter()
    per_chunk = [[] for _ in model]

    def hooks(v: int, chunk):
        state = {}

        def pre(_m, _a):
            if torch.is_grad_enabled():
                state["since"] = meter.serial
                state["scope"] = SavedTensorScope(f"chunk {v}").__enter__()

        def post(_m, _a, _o):
            scope = state.pop("scope", None)
            if scope is not None:
                scope.__exit__(None, None, None)
                per_chunk[v].append(meter.alive(since=state.pop("since")))

        chunk.register_forward_pre_hook(pre)
        chunk.register_forward_hook(post)

    for v, chunk in enumerate(model):
        hooks(v, chunk)
    data = _microbatches(int(cfg.model.vocab_size), seq_length, micro_batch_size, num_microbatches)
    iters = [iter(list(data)) for _ in model]
    for m in model:
        m.zero_grad_buffer()
    with meter.measure(root=False):
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iters if len(model) > 1 else iters[0],
            model=model if len(model) > 1 else model[0],
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=seq_length,
            forward_only=False,
        )
    out = {
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "per_chunk_device": [sum(d for d, _ in x) / len(x) for x in per_chunk],
        "per_chunk_host": [sum(h for _, h in x) / len(x) for x in per_chunk],
        "peak_device": meter.peak_device,
        "peak_host": meter.peak_host,
    }
    del model, chunks
    gc.collect()
    return out


def main() -> None:
    from k2.config.load import load_config
    from k2.launcher.training.prepare import prepare_run
    from k2.parallel import cpu_backend
    from k2.parallel.distributed import destroy_distributed, dist_env, init_distributed

    cpu_backend.enable()
    base = sys.argv[1:]
    cfg = load_config(base)
    env = dist_env()
    plan = prepare_run(cfg, env.world_size)
    init_distributed(env, plan.dims, cfg.run.seed)
    out = {"rank": env.rank, "cases": {}}
    for name, overrides, seq, mbs, m in json.loads(os.environ["K2_MEASURE_CASES"]):
        out["cases"][name] = measure(load_config([*base, *overrides]), plan.dims, seq, mbs, m)
    Path(os.environ["K2_TEST_OUT"]).mkdir(parents=True, exist_ok=True)
    Path(os.environ["K2_TEST_OUT"], f"saved_rank{env.rank}.json").write_text(json.dumps(out))
    destroy_distributed()


if __name__ == "__main__":
    main()
