"""k2-plan's memory terms that only a GPU run holds, checked through what CPU code can show.

* Host: on a GPU every offload buffer is pinned, and torch's CachingHostAllocator rounds each pinned block
  up to a power of two and keeps it (launcher/planning/host_pinned.py). The plan sizes the offloaded
  optimizer states by that rule over the very buffers the trainer's offload allocates, and the offloaded
  activations per saved entry.
* GPU: the max-logit pass's score block and the grouped GEMM's stacked expert weights are planned from
  the peak those functions allocate on CPU (tests/unit/model/test_grouped_mlp.py has the stack's), and the
  fullest GPU's total is its allocated peak plus the reserved terms (plan.gpu_overheads).
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch

from k2.config import load_config
from k2.launcher.planning.device_memory import max_logit_block_bytes, nccl_communicators
from k2.launcher.planning.host_pinned import pinned_block_bytes
from support.helpers import build_one_rank, predict_state_bytes

GIB = 2**30


def _caching_host_allocator(nbytes: int) -> int:
    """torch 2.11's rule (ATen/core/CachingHostAllocator.h: roundSize = c10::llvm::PowerOf2Ceil(size)),
    written another way: 2 ** ceil(log2 n)."""
    return 0 if nbytes == 0 else 2 ** math.ceil(math.log2(nbytes))


def test_pinned_blocks_are_the_next_power_of_two():
    sizes = [0, 1, 2, 3, 4095, 4096, 4097, 3 * 2**20, 2**30 - 1, 2**30, 2**30 + 1, int(1.1 * 2**30), 10**12]
    assert [pinned_block_bytes(n) for n in sizes] == [_caching_host_allocator(n) for n in sizes]
    assert pinned_block_bytes(1.5) == 2 and pinned_block_bytes(int(1.1 * 2**30)) == 2 * 2**30


def test_offloaded_optimizer_states_are_planned_as_the_pinned_blocks_of_the_trainers_buffers(megatron_world1):
    """optim.offload_fraction=1: every master copy and state tensor gets its own host buffer
    (optim/offload.py); on a GPU each is a pinned block rounded up to a power of two. The plan's host
    bytes of the GPU are the sum of those blocks over the buffers the trainer's offload allocated (raw
    bytes before this rule: the plan counted what the copies move, not what stays pinned)."""
    from k2.launcher.planning.cluster import plan_cluster

    overrides = [
        "parallel=single",
        "optim=muonclip",
        "train.precision=bf16",
        "optim.offload_fraction=1",
        "model.num_layers=2",
        "model.first_k_dense_replace=1",
    ]
    _, _, model, optimizer = build_one_rank(overrides)
    for m in model:  # one step: the optimizer states exist (and are offloaded) from then on
        for buf in [*m.buffers, *m.expert_parallel_buffers]:
            buf.grad_data.normal_(0, 1e-2)
    assert optimizer.step()[0]
    buffers = list(optimizer.offload._host.values())
    want = sum(_caching_host_allocator(t.numel() * t.element_size()) for t in buffers)
    raw = sum(t.numel() * t.element_size() for t in buffers)
    assert want > raw  # (the rule matters for these shapes)
    assert predict_state_bytes(overrides, 1)[0][0].optimizer_pinned == want
    plan = plan_cluster(
        load_config([*overrides, "cluster.nodes=1", "cluster.gpus_per_node=1", "checkpoint.async_save=false"])
    ).report
    assert {p["host_bytes_per_gpu_peak"] for p in plan["phases"]} == {want}


def test_offloaded_activations_are_planned_per_saved_entry_as_pinned_blocks():
    """model/saved_tensors.py pins one host buffer per offloaded storage and microbatch: each offloaded
    entry of the activation inventory is one block (and only the offloaded ones)."""
    from k2.launcher.planning.activation_bytes import apply_switches, layer_saved

    cfg = load_config(["model=kimi_k2"])
    saved = layer_saved(cfg.model, True, 4096, 1, "bf16", True)
    sites = ["attn_input", "core_attn", "fc2_input"]
    gpu, host = apply_switches(saved, offload=sites)
    gpu2, pinned = apply_switches(saved, offload=sites, host_block=pinned_block_bytes)
    entries = [x.nbytes for x in saved if x.offload in sites]
    assert gpu2 == gpu and host == pytest.approx(sum(entries))
    assert pinned == sum(_caching_host_allocator(math.ceil(n)) for n in entries) > host


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The peak bytes of tensors created inside the mode and still alive (a storage counted once; the
    storages of ``inputs``, which views inside the mode return, are not new)."""

    def __init__(self, *inputs):
        super().__init__()
        self.live = self.peak = 0
        self.seen = {t.untyped_storage().data_ptr() for t in inputs}

    def _free(self, key, n):
        self.live -= n
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.seen:
                    self.seen.add(key)
                    self.live += st.nbytes()
                    weakref.finalize(st, self._free, key, st.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def test_the_max_logit_pass_peak_is_the_plans_score_block():
    """The chunked torch max-logit pass (model/attention.py) on CPU: the peak of what it allocates is the
    planned block (scores of one chunk of query rows against the keys before it), within the few small
    index tensors it also makes."""
    from k2.model.attention import per_head_max_logit

    b, heads, s, d, chunk = 1, 4, 64, 2, 16
    q, k = torch.randn(b, heads, s, d), torch.randn(b, heads, s, d)
    with _LiveBytes(q, k) as meter:
        per_head_max_logit(q, k, 0.5, causal=True, chunk=chunk)
    planned = max_logit_block_bytes(b, heads, s, 4, chunk)
    assert planned <= meter.peak <= 1.05 * planned, (meter.peak, planned)


@pytest.fixture(scope="module")
def k2_32_nodes():
    from k2.launcher.planning.cluster import plan_cluster

    return plan_cluster(load_config(["model=kimi_k2", "parallel=k2_256gpu", "cluster.nodes=32"])).report


def test_the_fullest_k2_gpu_holds_the_score_block_and_the_reserved_terms(k2_32_nodes):
    """K2 on 32 nodes, its 32K-token phase (the fullest): the transient term is the max-logit pass's
    3.9 GiB score block (64 heads, 1,024 query rows against up to 31,744 keys, BF16), the reserved term
    the CUDA context, NCCL buffers of the rank's 6 communicators that carry traffic (world, DP, EP, PP,
    embedding, model-parallel), workspaces and 5% of the allocated peak; the total is both on top of
    state and activations, and it still fits 80 GiB."""
    from k2.launcher.planning.cluster import plan_cluster

    m = k2_32_nodes["memory_per_gpu_bytes"]
    assert m["phase"] == "anneal_32k"
    assert m["transient"] == max_logit_block_bytes(1, 64, 32768, 2, 1024) == 64 * 1024 * 31744 * 2
    allocated = m["params"] + m["grads"] + m["optimizer"] + m["activations"] + m["transient"]
    assert m["reserved"] == pytest.approx((0.5 + 6 * 0.25 + 0.25) * GIB + 0.05 * allocated)
    assert m["total"] == pytest.approx(allocated + m["reserved"])
    assert k2_32_nodes["fits"] and m["total"] <= 80 * GIB
    assert k2_32_nodes["cuda_alloc_conf"] == "expandable_segments:True"
    # the Triton kernel keeps no score block: the grouped GEMM's stacked fc1 weights are the largest
    # transient then (24 local experts x 4,096 x 7,168 in BF16)
    triton = plan_cluster(
        load_config(["model=kimi_k2", "parallel=k2_256gpu", "cluster.nodes=32", "model.max_logit_kernel=triton"])
    ).report["memory_per_gpu_bytes"]
    assert triton["transient"] == 24 * 2 * 2048 * 7168 * 2


def test_nccl_communicators_count_the_groups_with_more_than_one_rank():
    from k2.parallel.dims import ParallelDims

    cfg = load_config(["model=kimi_k2", "parallel=k2_256gpu"])
    assert nccl_communicators(ParallelDims.from_config(cfg.parallel, cfg.model, 256)) == 6
    one = load_config([])
    assert nccl_communicators(ParallelDims.from_config(one.parallel, one.model, 1)) == 0
