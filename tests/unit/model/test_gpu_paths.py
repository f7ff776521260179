"""The CUDA-only branches of the GPU path, checked on CPU where a CPU run can show them:
BF16 under megatron's mixed-precision wrapper, the offload streams' ordering, where the model's modules
land, the BF16 baseline of bench=step, ``torch._grouped_mm``'s CUDA requirements on our calls, and the
Triton max-logit kernel compiled for Hopper. What no CPU run can show (speed, cuDNN's kernel choice,
CUDA memory) is measured by ``benchmarks/gpu_session.sh`` on a GPU."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

# --- BF16: megatron's Float16Module casts every floating buffer, our fp32 accumulators included ---------


def test_max_logits_stay_fp32_after_bf16_cast(megatron_world1):
    """train.precision=bf16 wraps the model in megatron's Float16Module (``module.bfloat16()``), which
    casts the max-logit buffer too; the recorded running max must stay the exact fp32 value of the sdpa
    path (QK-Clip compares it with tau)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from k2.model.attention import K2CoreAttention, per_head_max_logit

    b, h, s, dk, dv = 1, 4, 16, 48, 32
    scale = 1.0 / math.sqrt(dk)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=h, attention_dropout=0.0, use_cpu_initialization=True
    )
    mod = (
        K2CoreAttention(
            cfg,
            layer_number=1,
            attn_mask_type=AttnMaskType.causal,
            attention_type="self",
            softmax_scale=scale,
            k_channels=dk,
            v_channels=dv,
            pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1)),
            record_max_logits=True,
            backend="sdpa",
        )
        .bfloat16()
        .train()
    )
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(s, b, h, dk, generator=gen).bfloat16() * 3 for _ in range(2))
    v = torch.randn(s, b, h, dv, generator=gen).bfloat16()
    mod(q, k, v, None)
    expected = per_head_max_logit(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), scale, causal=True)
    assert mod.max_logits.dtype == torch.float32
    assert torch.equal(mod.max_logits, expected)  # not rounded to bf16
    assert not torch.equal(expected, expected.bfloat16().float())  # (the case shows the rounding)


# --- offload on CUDA: the host-to-device copies wait for the compute stream ------------------------------


def test_offload_reload_waits_for_the_compute_stream(monkeypatch):
    """The reloaded device buffers come from the compute stream's allocator pool, which may hand out
    memory that kernels already queued on that stream still use; the copies into them (on the
    host-to-device stream) must be ordered after that work. Recorded with stand-in streams."""
    from k2.model import saved_tensors as st

    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append((self.name, "wait_stream", other.name))

        def wait_event(self, event):
            log.append((self.name, "wait_event"))

    class Event:
        def record(self, stream=None):
            log.append((stream.name, "record"))

    class Copy:
        def reload(self, stream):
            log.append((stream.name, "copy"))

    compute, d2h, h2d = Stream("compute"), Stream("d2h"), Stream("h2d")
    monkeypatch.setattr(st._Streams, "get", classmethod(lambda cls: (d2h, h2d)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: compute)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    scope = st.SavedTensorScope("layer 1")
    scope.state, scope.d2h_event, scope.copies = "offloaded", object(), [Copy(), Copy()]
    scope.reload_async()
    assert ("h2d", "wait_event") in log  # after the device-to-host copy ...
    first_copy = log.index(("h2d", "copy"))
    assert ("h2d", "wait_stream", "compute") in log[:first_copy]  # ... and after the queued compute work
    assert log[-1] == ("h2d", "record")


# --- where the model lives: every module on the current CUDA device ------------------------------------


def test_model_chunks_are_moved_to_the_current_device(megatron_world1, monkeypatch):
    """On CUDA megatron creates its layers on ``torch.cuda.current_device()`` but torch's RMSNorm modules
    and the router weight on the host; without the distributed optimizer (whose parameter buffer moves
    the parameters) the first forward would mix devices. Shown with the meta device standing in for
    the current CUDA device."""
    from k2.config.load import load_config
    from k2.model.build import build_model_chunks, transformer_config
    from k2.parallel.dims import ParallelDims

    cfg = load_config(
        ["model=k2_tiny", "model.num_layers=2", "model.attention_backend=eager", "model.moe_grouped_gemm=false"]
    )
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    tcfg = transformer_config(cfg, dims)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("meta"))
    chunks = build_model_chunks(cfg, dims, tcfg)
    monkeypatch.undo()
    tensors = [(n, t) for c in chunks for n, t in [*c.named_parameters(), *c.named_buffers()]]
    assert any(".layernorm." in n or "layernorm.weight" in n for n, _ in tensors)
    assert [n for n, t in tensors if t.device.type != "meta"] == []


# --- bench=step's baseline in bf16 ---------------------------------------------------------------------


def test_step_bench_baseline_parameters_in_the_compute_dtype(megatron_world1):
    """The plain megatron-core baseline of bench=step holds every parameter in the compute dtype (the
    K2 cases get that from megatron's Float16Module); fp32 norm weights would put its RMSNorms on
    torch's unfused mixed-dtype path on GPU."""
    from k2.launcher.benchmarks.step import DEFAULTS, base_overrides
    from k2.launcher.benchmarks.step_cases import build_baseline

    o = dict(DEFAULTS, size="tiny", precision="bf16", seq_length=16, microbatches=1, warmup=1, repeats=1)
    case = build_baseline(o, base_overrides(o), torch.device("cpu"))
    cells = [c.cell_contents for c in case._step.__closure__]  # (the step function holds the model)
    model = next(c for c in cells if isinstance(c, torch.nn.Module))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert any("layernorm" in n for n in dtypes)
    assert {n for n, d in dtypes.items() if d != torch.bfloat16} == set()
    case.step()  # and it trains in bf16


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_step_bench_released_case_is_freed(megatron_world1, monkeypatch, precision):
    """bench=step keeps 3 cases resident on a GPU and releases each group of toggled cases before the
    next: a released K2 case's model (and with it its gradient buffers and optimizer states) must be
    freed, else the third group does not fit in an H200's memory."""
    import gc
    import weakref

    import k2.launcher.training.setup as setup_module  # the builder bench=step's K2 cases use
    from k2.launcher.benchmarks.step import DEFAULTS, base_overrides, case_overrides
    from k2.launcher.benchmarks.step_cases import build_k2

    built = []
    real = setup_module.build_model_chunks

    def recording(*args, **kwargs):
        chunks = real(*args, **kwargs)
        built.extend(weakref.ref(c) for c in chunks)
        return chunks

    monkeypatch.setattr(setup_module, "build_model_chunks", recording)
    o = dict(DEFAULTS, size="tiny", precision=precision, seq_length=16, microbatches=1, warmup=1, repeats=1)
    case = build_k2(o, base_overrides(o), case_overrides(o)["k2_no_muon"])
    case.step()
    case.release()
    del case
    gc.collect()
    assert built and all(ref() is None for ref in built)


# --- torch._grouped_mm: our calls meet the CUDA kernel's requirements ----------------------------------


def test_grouped_gemm_calls_meet_the_cuda_requirements(megatron_world1, monkeypatch):
    """Every ``torch._grouped_mm`` call of the grouped experts in bf16 (forward, input gradient, weight
    gradient; experts with no tokens; FP8 storage and recompute of the expert activations) passes the
    checks of the CUDA kernel: BF16 operands (its CUTLASS path), the stride/shape checks of torch's meta
    function (which mirror ``_grouped_mm_cuda``), 16-byte aligned data pointers (checked on CUDA only),
    and an output of the same contiguous layout as on CPU (CUDA pads rows to 16 bytes)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    import k2.model.grouped_mlp as gm
    from k2.model.activation_memory import MemoryOptions
    from k2.model.saved_tensors import SavedTensorScope

    e, hidden, ffn = 4, 64, 24  # multiples of 8 (K2: 7168 / 2048)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=2,
        num_moe_experts=e,
        moe_ffn_hidden_size=ffn,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        bf16=True,
        gradient_accumulation_fusion=False,
    )
    mod = gm.K2GroupedMLP(
        e,
        cfg,
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    calls = []
    real = gm._grouped_mm

    def checked(a, b, offs):
        assert a.dtype == b.dtype == torch.bfloat16 and offs.dtype == torch.int32
        assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
        meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (a, b, offs)]
        out_meta = torch._grouped_mm(meta[0], meta[1], offs=meta[2])  # raises where CUDA would
        out = real(a, b, offs)
        assert out_meta.shape == out.shape and out_meta.stride() == out.stride()
        calls.append((a.dim(), b.dim()))
        return out

    monkeypatch.setattr(gm, "_grouped_mm", checked)
    k2 = MemoryOptions(
        fp8_store=frozenset({"moe_fc1_input", "swiglu_input"}), recompute=frozenset({"swiglu", "moe_down_proj"})
    )
    gen = torch.Generator().manual_seed(0)
    # (recompute=moe_down_proj re-runs fc2's forward in backward: one more 2d x 3d call)
    for counts, memory, forward_calls in (([5, 0, 9, 2], None, 2), ([0, 7, 0, 3], k2, 3)):
        calls.clear()
        t = sum(counts)
        x = torch.randn(t, hidden, generator=gen).bfloat16().requires_grad_()
        probs = torch.rand(t, generator=gen).requires_grad_()
        mod.memory = memory
        with SavedTensorScope("layer 1"):
            y, _ = mod(x, torch.tensor(counts), probs)
        y.float().pow(2).sum().backward()
        # fc1 and fc2: forward (2d x 3d), input gradient (2d x 3d), weight gradient (2d x 2d)
        assert sorted(calls) == [(2, 2)] * 2 + [(2, 3)] * (2 + forward_calls)
        for j in (i for i, c in enumerate(counts) if c == 0):  # no tokens: zero weight gradient
            assert not mod.local_experts[j].linear_fc1.weight.grad.any()
        mod.zero_grad(set_to_none=True)


# --- the Triton max-logit kernel compiles for Hopper ---------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_max_logit_kernel_compiles_for_sm90(causal):
    """model.max_logit_kernel=triton on an H100/H200: the kernel compiles to a cubin for sm_90 with K2's
    head dim (192, tiles of 256) in bf16 (Triton's CPU interpreter, which the numerical tests use,
    does not run the compiler). Ahead-of-time, no GPU needed."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k2.model.max_logit_kernel import _block_max_kernel

    ints = [
        "stride_qb",
        "stride_qh",
        "stride_qs",
        "stride_qd",
        "stride_kb",
        "stride_kh",
        "stride_ks",
        "stride_kd",
        "H",
        "SQ",
        "D",
        "OFFSET",
        "NUM_M",
    ]
    const = {"SK": 4096, "CAUSAL": causal, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 256, "IEEE": False}
    sig = {"Q": "*bf16", "K": "*bf16", "Out": "*fp32", **{n: "i32" for n in ints}, **{n: "constexpr" for n in const}}
    names = list(sig)
    src = ASTSource(fn=_block_max_kernel, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024  # fits an H100/H200 SM
