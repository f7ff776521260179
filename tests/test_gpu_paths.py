"""The CUDA-only branches of the GPU path (issue 10), checked on CPU where a CPU run can show them:
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

    from model.attention import K2CoreAttention, per_head_max_logit

    b, h, s, dk, dv = 1, 4, 16, 48, 32
    scale = 1.0 / math.sqrt(dk)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=h, attention_dropout=0.0,
                            use_cpu_initialization=True)
    mod = K2CoreAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                          softmax_scale=scale, k_channels=dk, v_channels=dv,
                          pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1)),
                          record_max_logits=True, backend="sdpa").bfloat16().train()
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(s, b, h, dk, generator=gen).bfloat16() * 3 for _ in range(2))
    v = torch.randn(s, b, h, dv, generator=gen).bfloat16()
    mod(q, k, v, None)
    expected = per_head_max_logit(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), scale, causal=True)
    assert mod.max_logits.dtype == torch.float32
    assert torch.equal(mod.max_logits, expected)  # not rounded to bf16
    assert not torch.equal(expected, expected.bfloat16().float())  # (the case shows the rounding)


def test_router_step_counts_stay_exact_after_bf16_cast(megatron_world1):
    """The per-step expert token counts (moe_load_max_over_mean) are summed in fp32 after the bf16 cast:
    in bf16, 257 tokens would count as 256."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from model.router import K2Router

    cfg = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=8, moe_router_topk=2,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none", moe_router_dtype="fp32", use_cpu_initialization=True,
        add_bias_linear=False,
    )
    router = K2Router(config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    router.set_layer_number(2)
    router.bfloat16().train()
    router.step_tokens_per_expert.zero_()
    router.routing(torch.zeros(257, 1, 8))  # ties: experts 0 and 1 take every token
    assert router.step_tokens_per_expert.dtype == torch.float32
    assert router.step_tokens_per_expert.tolist() == [257, 257, 0, 0, 0, 0, 0, 0]


# --- offload on CUDA: the host-to-device copies wait for the compute stream ------------------------------


def test_offload_reload_waits_for_the_compute_stream(monkeypatch):
    """The reloaded device buffers come from the compute stream's allocator pool, which may hand out
    memory that kernels already queued on that stream still use; the copies into them (on the
    host-to-device stream) must be ordered after that work. Recorded with stand-in streams."""
    from model import saved_tensors as st

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
    from launcher.config import load_config
    from model.build import build_model_chunks, transformer_config
    from parallel.dims import ParallelDims

    cfg = load_config(["model=k2_tiny", "model.num_layers=2", "model.attention_backend=eager",
                       "model.moe_grouped_gemm=false"])
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
    from launcher.bench_step import DEFAULTS, _base_overrides, _build_baseline

    o = dict(DEFAULTS, size="tiny", precision="bf16", seq_length=16, microbatches=1, warmup=1, repeats=1)
    case = _build_baseline(o, _base_overrides(o), torch.device("cpu"))
    cells = [c.cell_contents for c in case._step.__closure__]  # (the step function holds the model)
    model = next(c for c in cells if isinstance(c, torch.nn.Module))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert any("layernorm" in n for n in dtypes)
    assert {n for n, d in dtypes.items() if d != torch.bfloat16} == set()
    case.step()  # and it trains in bf16

