"""The cost of one operator on the trainer's own modules, for ``k2-bench bench=hardware`` and
``bench=perf_model``: what ``k2-plan``'s step-time model charges per counted operator on a device whose
step is bound by operator dispatch (a CPU running a small model) rather than by arithmetic.

The main job's model (``k2_tiny``, ``parallel=single``, FP32, megatron's sequential experts, AdamW, the
modules ``k2-train`` builds: :func:`k2.launcher.benchmarks.step_cases.build_k2`) is built once in this
process; its parts run alone, at the measuring size of one microbatch (``micro_batch_size=2 x
seq_length=128`` tokens):

* ``moe_layer``: forward + backward of one MoE transformer layer (MLA, router, shared and routed experts,
  megatron's gradient-accumulation hooks) on a random hidden state ``[s, b, h]``;
* ``dense_layer``: the same of the first (dense) layer;
* ``embedding``: the word embedding's forward + backward;
* ``head``: the final RMSNorm, the output layer and the cross-entropy loss, forward + backward;
* ``optimizer``: one optimizer step (megatron's distributed optimizer over torch's AdamW; no backward);
* ``schedule_1`` / ``schedule_3``: one and three microbatches through megatron's schedule (the trainer's
  forward-step and loss functions, megatron's backward step and gradient finalisation): their time
  beyond the parts' gives the schedule's own cost per microbatch (``(schedule_3 - schedule_1) / 2`` less
  one microbatch of parts) and per step (``schedule_1`` less one microbatch of parts and that).

Each part's aten operators are counted once with torch's dispatch mode (``TorchDispatchMode``: every
operator that reaches the dispatcher, views included), forward and backward apart; its GEMMs' shapes
and its other operators' tensor bytes are recorded. Each part is then timed ``repeats`` times, the parts
in turn (round-robin: a change of the machine's load hits all alike), and its fastest run kept (as
``bench=hardware``'s other figures: the machine's capability, least disturbed by other load; the median
is kept beside it). After each part, in the same turn, its recorded GEMMs are run alone at their shapes
(``gemm_s``, the fastest; one microbatch's GEMM FLOPs over their ``gemm_s``, the layers, the embedding and
the head together, is the profile's CPU GEMM rate: the rate at the job's own shapes and mix).
The cost per operator is what the part's time leaves after its GEMMs, over its counted operators: the
dispatch, the module code around the operator and, at this size, its memory traffic (the other
operators' bytes at the measured memory bandwidth, ``bytes_s``, are printed: a few percent here).

torch has no per-operator cost figure of its own; the profiler's per-operator self time excludes the
Python module code between operators, which is what dominates here, hence this measurement.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

from k2.launcher.benchmarks.common import interleaved_samples
from k2.launcher.planning import KernelRates, gemm_seconds

#: the parts measured (module docstring)
PARTS = ("moe_layer", "dense_layer", "embedding", "head", "optimizer")
_PRICED = PARTS  # the parts whose GEMMs are timed alone (not the schedule runs: their GEMMs are the parts')
_GEMMS = ("mm", "addmm", "bmm", "baddbmm")


def _counter():
    """A dispatch mode counting operators, the GEMMs' ``(m, k, n, batch)`` and the other operators'
    bytes (inputs + outputs of operators that allocate an output)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0
            self.gemms: list[tuple[int, int, int, int]] = []
            self.nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops += 1
            name = func.overloadpacket.__name__
            tensors = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
            if name in _GEMMS:
                a, b = tensors[-2], tensors[-1]
                batch = a.shape[0] if a.dim() == 3 else 1
                self.gemms.append((a.shape[-2], a.shape[-1], b.shape[-1], batch))
            else:
                outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
                ptrs = {t.untyped_storage().data_ptr() for t in tensors}
                fresh = [o for o in outs if o.untyped_storage().data_ptr() not in ptrs]
                if fresh:  # views and in-place operators move no new tensor
                    self.nbytes += sum(t.nbytes for t in tensors + fresh)
            return out

    return Counter()


def _parts(case, seq_length: int, micro_batch_size: int) -> dict[str, tuple[Callable, Callable | None]]:
    """Per part: a forward returning a scalar to differentiate (or None: the optimizer) and nothing else."""
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from k2.launcher.training.step import loss_func

    gpt = case.model[0].module
    while not hasattr(gpt, "decoder"):  # Float16Module (BF16) wraps the GPTModel once more
        gpt = gpt.module
    layers = list(gpt.decoder.layers)
    moe = next(layer for layer in layers if "MoE" in type(layer.mlp).__name__)
    dense = next(layer for layer in layers if "MoE" not in type(layer.mlp).__name__)
    dev = next(gpt.parameters()).device
    dtype = next(gpt.decoder.parameters()).dtype
    s, b, h = seq_length, micro_batch_size, gpt.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(s, b, h, generator=gen).to(dev, dtype).requires_grad_(True)
    tokens = torch.randint(0, gpt.vocab_size, (b, s), generator=gen).to(dev)
    labels = torch.randint(0, gpt.vocab_size, (b, s), generator=gen).to(dev)
    pos = torch.arange(s, device=dev).unsqueeze(0).expand(b, s)
    mask = torch.ones(b, s, device=dev)

    def layer_fwd(layer):
        def fwd():
            MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=dev))
            out = layer(x)
            return (out[0] if isinstance(out, tuple) else out).float().sum()

        return fwd

    def embedding():
        return gpt.embedding(input_ids=tokens, position_ids=pos).float().sum()

    def head():
        hidden = gpt.decoder.final_layernorm(x)
        logits, _ = gpt.output_layer(hidden)
        return loss_func(mask, gpt.compute_language_model_loss(labels, logits))[0]

    return {
        "moe_layer": (layer_fwd(moe), None),
        "dense_layer": (layer_fwd(dense), None),
        "embedding": (embedding, None),
        "head": (head, None),
        "optimizer": (None, case.optimizer.step),
        "schedule_1": (None, lambda: case.schedule(1)),
        "schedule_3": (None, lambda: case.schedule(3)),
    }


def _gemm_pass(gemms: list) -> tuple[float, Callable]:
    """FLOPs of the recorded GEMMs ``(m, k, n, batch)`` and a function that runs them all alone at their
    shapes, each as often as recorded: what the part's GEMMs cost at this machine's rate."""
    import torch

    flops, calls = 0.0, []
    for (m, k, n, b), count in Counter(gemms).items():
        x, y = torch.randn(b, m, k), torch.randn(b, k, n)
        fn = (lambda x=x, y=y: torch.bmm(x, y)) if b > 1 else (lambda x=x, y=y: torch.mm(x[0], y[0]))
        flops += count * 2.0 * b * m * k * n
        calls += [fn] * count

    def run() -> None:
        for fn in calls:
            fn()

    return flops, run


def _run(fwd, other) -> None:
    if fwd is not None:
        fwd().backward()
    else:
        other()


def _counted_part(name: str, fwd, other, rates: KernelRates) -> tuple[dict[str, Any], Callable[[], None] | None]:
    """One part run once untimed, then once with its operators counted: its row of counts (forward and
    backward operators, GEMMs and their FLOPs, their model seconds at ``rates``, its other operators' bytes
    in seconds at the memory rate) and, for a priced part, a function running its GEMMs alone (warmed up)."""
    import dataclasses

    _run(fwd, other)  # warm-up (allocations, lazy state)
    counter = _counter()
    with counter:
        loss = fwd() if fwd is not None else other()
    forward_ops = counter.ops
    if fwd is not None:
        with counter:
            loss.backward()
    flops, gemm_run = _gemm_pass(counter.gemms) if name in _PRICED else (0.0, None)
    if gemm_run is not None:
        gemm_run()  # (warm-up)
    bare = dataclasses.replace(rates, launch_s=0.0)
    row = {
        "forward_ops": forward_ops,
        "backward_ops": counter.ops - forward_ops,
        "gemms": len(counter.gemms),
        "gemm_flops": flops,
        "gemm_model_s": sum(g * gemm_seconds(m, k, n, bare) for m, k, n, g in counter.gemms),
        "bytes_s": counter.nbytes / rates.memory_bytes,
    }
    return row, gemm_run


def _schedule_cost(case, samples: dict[str, list[float]]) -> dict[str, Any]:
    """The schedule's own cost (module docstring) from the parts' timed runs (s): per microbatch
    (``microbatch_us``) and per step (``step_us``), beside one microbatch of parts (``parts_per_microbatch_s``:
    the model's MoE and dense layers, the embedding and the head, each at its fastest run)."""
    gpt = case.model[0].module
    while not hasattr(gpt, "decoder"):
        gpt = gpt.module
    kinds = ["MoE" in type(layer.mlp).__name__ for layer in gpt.decoder.layers]
    parts_s = (
        sum(kinds) * min(samples["moe_layer"])
        + (len(kinds) - sum(kinds)) * min(samples["dense_layer"])
        + min(samples["embedding"])
        + min(samples["head"])
    )
    one, three = min(samples["schedule_1"]), min(samples["schedule_3"])
    per_mb = max((three - one) / 2 - parts_s, 0.0)
    return {
        "microbatch_us": per_mb * 1e6,
        "step_us": max(one - parts_s - per_mb, 0.0) * 1e6,
        "parts_per_microbatch_s": parts_s,
        "moe_layers": sum(kinds),
        "dense_layers": len(kinds) - sum(kinds),
    }


def measure_operator_cost(rates: KernelRates, repeats: int, *, case=None, sync=lambda: None) -> dict[str, Any]:
    """Each part's counted operators, time and cost per operator (module docstring).

    Args:
        rates: the measured rates (``gemm_model_s``: the GEMMs at ``gemm_flops``; ``bytes_s``: at
            ``memory_bytes``).
        repeats: timed runs per part (after one untimed).
        case: a built ``k2_tiny`` case (:func:`build_case`); None = build one here and release it.
        sync: the device's synchronisation (CUDA).

    Returns:
        per part: ``forward_ops``, ``backward_ops``, ``gemms`` (count), ``seconds`` (fastest run),
        ``seconds_median``, ``gemm_flops`` and ``gemm_s`` (its GEMMs run alone), ``gemm_model_s`` (at
        ``rates``), ``bytes_s`` (its other operators' bytes at the memory rate) and ``per_op_us``; and
        ``schedule``: ``microbatch_us``, ``step_us`` (the schedule's own cost), ``parts_per_microbatch_s``.
    """
    own = case is None
    if own:
        case, teardown = build_case()
    try:
        parts = _parts(case, 128, 2)
        out: dict[str, Any] = {}
        gemm_runs: dict[str, Callable] = {}
        for name, (fwd, other) in parts.items():
            out[name], gemm_run = _counted_part(name, fwd, other, rates)
            if gemm_run is not None:
                gemm_runs[name] = gemm_run
        # each part and then its GEMMs alone, in turn: a change of the machine's load hits a part's run and its
        # GEMMs' alike (timed apart, a slow stretch during the GEMMs made them longer than the whole part)
        turn: dict[str, Callable] = {}
        for name, (fwd, other) in parts.items():
            turn[name] = lambda f=fwd, o=other: _run(f, o)
            if name in gemm_runs:
                turn[f"{name}/gemms"] = gemm_runs[name]
        samples = interleaved_samples(turn, repeats, sync)
        for m in case.model:
            m.zero_grad_buffer()
        out["schedule"] = _schedule_cost(case, samples)
        for name, row in out.items():
            if name == "schedule":
                continue
            row["gemm_s"] = min(samples[f"{name}/gemms"]) if name in gemm_runs else 0.0
            row["seconds"] = min(samples[name])
            row["seconds_median"] = statistics.median(samples[name])
            ops = row["forward_ops"] + row["backward_ops"]
            row["per_op_us"] = max(row["seconds"] - row["gemm_s"], 0.0) / ops * 1e6
    finally:
        if own:
            case.release()
            teardown()
    return out


def build_case(model_overrides=()):
    """The main job's model, its DDP wrapper and optimizer as ``k2-train`` builds them (``k2_tiny``,
    ``parallel=single``, FP32, AdamW, sequential experts; ``model_overrides``: settings of another member of
    the family, e.g. ``bench=ep_overlap``'s wider experts) on a one-rank world; returns ``(case,
    teardown)`` (release the case, then call ``teardown``)."""
    from k2.launcher.benchmarks import step as step_bench
    from k2.launcher.benchmarks.common import one_rank_world
    from k2.launcher.benchmarks.step_cases import build_k2
    from k2.parallel import cpu_backend

    cpu_backend.enable()
    teardown = one_rank_world()
    o = dict(
        step_bench.DEFAULTS,
        size="tiny",
        precision="fp32",
        seq_length=128,
        microbatches=8,
        micro_batch_size=2,
        memory="none",
    )
    case = build_k2(
        o,
        [
            "model=k2_tiny",
            "train.precision=fp32",
            "run.wandb.mode=disabled",
            "parallel=single",
            "train.micro_batch_size=2",
            *model_overrides,
        ],
        ["optim=adamw", "model.moe_grouped_gemm=false"],
    )
    case.step()
    return case, teardown


def _rank_worker(conn, model_overrides=()) -> None:
    """One measuring process: builds the case once, then serves ``("ops", threads, rates, repeats)`` (the
    operator figures with ``threads`` threads), ``("call", fn)`` (``fn(case)``) and ``("stop",)``."""
    import torch

    case, teardown = build_case(model_overrides)
    try:
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            try:
                if cmd[0] == "ops":
                    torch.set_num_threads(cmd[1])
                    conn.send(measure_operator_cost(KernelRates(**cmd[2]), cmd[3], case=case))
                else:
                    conn.send(cmd[1](case))
            except Exception as e:
                conn.send(e)
    finally:
        case.release()
        teardown()


class OperatorRanks:
    """``ranks`` processes with the main job's model built in each (:func:`build_case`), which measure the
    per-operator cost at the same time: the share of the CPU each of that many trainer ranks gets (two
    ranks of ``parallel=pp2`` contend for the cores as its two trainer processes do). Close with
    :meth:`close` (or use as a context manager). ``model_overrides``: :func:`build_case`'s."""

    def __init__(self, ranks: int, model_overrides=()):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for _ in range(ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_worker, args=(child, tuple(model_overrides)), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        for conn in self._conns:
            self._get(conn)

    @staticmethod
    def _get(conn, timeout: float = 600.0):
        if not conn.poll(timeout):
            raise TimeoutError("an operator-cost measuring process did not answer")
        out = conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def measure(self, ranks: int, threads: int, rates: KernelRates, repeats: int) -> dict[str, Any]:
        """The operator figures (:func:`measure_operator_cost`) measured by ``ranks`` of the processes at
        once with ``threads`` threads each: per part the mean over them of every number."""
        import dataclasses

        for conn in self._conns[:ranks]:
            conn.send(("ops", threads, dataclasses.asdict(rates), repeats))
        res = [self._get(conn) for conn in self._conns[:ranks]]
        return {part: {k: statistics.mean(r[part][k] for r in res) for k in row} for part, row in res[0].items()}

    def call(self, fn: Callable) -> Any:
        """``fn(case)`` in the first process (a module-level function)."""
        self._conns[0].send(("call", fn))
        return self._get(self._conns[0])

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs):
            try:
                conn.send(("stop",))
            except OSError:
                pass
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> OperatorRanks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
