"""Memory per GPU (launcher/planning/memory.py, launcher/planning/stage_activations.py,
launcher/planning/activation_bytes.py) against what the trainer allocates.

* parameter / gradient / optimizer bytes: predicted with megatron's buffer-layout functions, measured in
  a real 4-rank gloo build (and one-rank builds in this process) of the trainer's model, DDP and
  optimizer after one optimizer step (tests/support/scripts/measure_state_bytes.py): equal, byte for byte, on
  every rank;
* activation bytes of one microbatch: predicted from the saved-tensor inventory, measured through
  ``torch.autograd.graph.saved_tensors_hooks`` on the CPU proxy (each storage once, parameters excluded):
  within 15% with no memory switch (plain hooks written in the test; the meter of model/saved_tensors.py
  must count the same), within 10% with each FP8-storage, recompute and offload switch and with
  ``memory=k2`` (device and host bytes, through the meter);
* K2's figure (docs/k2_reference.md "Training system"): BF16 parameters + FP32 gradients ~ 6 TB over 256 GPUs.
"""

from __future__ import annotations

import pytest

from k2.config.load import load_config
from k2.model.params import count_params
from k2.parallel.dims import ParallelDims

# ---------------------------------------------------------------------------- states
from support.helpers import measure_state_bytes_script, predict_state_bytes


@pytest.mark.parametrize(
    "overrides",
    [
        ["optim=muonclip", "parallel.use_distributed_optimizer=false"],  # no ZeRO-1: full states
        ["optim=adamw", "train.precision=bf16"],  # ZeRO-1 over one rank: BF16 params + FP32 masters
    ],
    ids=["muonclip-fp32-no-zero", "adamw-bf16"],
)
def test_state_bytes_equal_allocation_one_rank(megatron_world1, overrides, tmp_path):
    """The same on one rank, in this process (megatron_world1): the paths the 4-rank runs do not take."""
    from k2.launcher.training.prepare import prepare_run

    measure = measure_state_bytes_script().measure

    # (a run dir of its own: the default runs/<model>-<parallel> may hold the user's run, which prepare_run
    # would resume from)
    cfg = load_config(["parallel=single", *overrides, f"run.dir={tmp_path / 'run'}"])
    m = measure(cfg, prepare_run(cfg, 1))
    p = predict_state_bytes(["parallel=single", *overrides], 1)[0][0]
    assert (p.params, p.grads, p.optimizer) == (m["params"], m["grads"], m["optimizer"]), m


def test_k2_param_and_grad_bytes():
    """K2: 6 B per parameter (BF16 weight + FP32 gradient) x 1.026T = 6.16 TB over 256 GPUs = 24 GB per GPU
    spread evenly. What megatron allocates per GPU is more: the non-expert parameters (11.7B) are
    replicated over the 16 DP ranks, and buffers are padded."""
    counts_cfg = ["model=kimi_k2", "parallel=k2_256gpu", "train.precision=bf16"]
    cfg = load_config(counts_cfg)
    total = count_params(cfg).total
    assert 6 * total == pytest.approx(6.16e12, rel=0.005)
    assert 6 * total / 256 == pytest.approx(24e9, rel=0.01)
    states = [x for row in predict_state_bytes(counts_cfg + ["optim=adamw"], 256) for x in row]
    per_gpu = [x.params + x.grads for x in states]
    assert 24e9 < sum(per_gpu) / 256 < 30e9  # 28.2 GB: + the replicated non-expert part
    unique = total + 15 * (total - 60 * 384 * 3 * 7168 * 2048)  # experts once, the rest on 16 DP ranks
    assert sum(x.param_numel for x in states) == unique
    # optimizer: AdamW's experts are not sharded at all (expert DP = dp / ep = 1): 12 B x 4.2B per GPU
    worst = max(states, key=lambda x: x.optimizer)
    assert worst.optimizer == pytest.approx(12 * 4 * 24 * 3 * 7168 * 2048, rel=0.03)


# ---------------------------------------------------------------------------- activations

# distinct widths, so that a tensor counted with the wrong shape shows
ODD = [
    "model.hidden_size=112",
    "model.ffn_hidden_size=200",
    "model.q_lora_rank=56",
    "model.kv_lora_rank=24",
    "model.qk_head_dim=20",
    "model.qk_pos_emb_head_dim=12",
    "model.v_head_dim=28",
    "model.num_attention_heads=3",
    "model.moe_ffn_hidden_size=44",
    "model.moe_shared_expert_intermediate_size=36",
    "model.num_moe_experts=6",
    "model.moe_router_topk=2",
]


def measure_saved_bytes(
    overrides: list[str], seq_length: int, micro_batch_size: int, meter: bool = True, per_site: bool = False
):
    """Bytes autograd keeps for backward after one microbatch's forward of the k2_tiny family built as
    ``k2-train`` builds it (one rank), on the device and offloaded to host: every storage a saved tensor
    lives in, once; parameters excluded. ``meter=True``: model/saved_tensors.py's ``SavedBytesMeter``
    (the only way to see FP8 payloads and offloaded copies: torch applies only the innermost saved-tensor
    hooks, which are the memory switches' own); ``meter=False``: plain ``saved_tensors_hooks`` written
    here, an independent count (valid without switches). ``per_site``: the meter's ``per_forward()`` dict
    (bytes by site) instead of the ``(device, host)`` totals."""
    import torch
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from k2.model.build import build_model_chunks, transformer_config

    cfg = load_config(["model=k2_tiny", *overrides])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    tcfg = transformer_config(cfg, dims)
    model = build_model_chunks(cfg, dims, tcfg)[0]
    if tcfg.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(tcfg, model)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (micro_batch_size, seq_length), generator=gen)
    position_ids = torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, seq_length)
    if meter:
        from k2.model.saved_bytes_meter import SavedBytesMeter

        meter = SavedBytesMeter()
        with meter.measure():
            loss = model(tokens, position_ids, None, labels=tokens)
        loss.sum().backward()
        per = meter.per_forward()
        return per if per_site else (int(per["device_total"]), int(per["host_total"]))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, position_ids, None, labels=tokens)
    loss.sum().backward()  # the graph was complete
    return sum(storages.values()), 0


def predict_saved_bytes(
    overrides: list[str], seq_length: int, micro_batch_size: int, offload: list[str] | None = None
) -> tuple[float, float]:
    """(device, host) bytes of the same microbatch from launcher/planning/activation_bytes.py (CPU kernels);
    ``offload``: these ``memory.offload`` sites instead of the config's."""
    from k2.launcher.planning.activation_bytes import apply_switches, layer_recompute_saved, layer_saved, stage_saved
    from k2.model.build import moe_layer_pattern

    cfg = load_config(["model=k2_tiny", *overrides])
    mem = cfg.get("memory")
    sw = {k: list(mem[k] or []) for k in ("fp8_store", "recompute", "offload")} if mem is not None else {}
    if offload is not None:
        sw["offload"] = list(offload)
    p = cfg.train.precision
    gpu, host = apply_switches(stage_saved(cfg.model, seq_length, micro_batch_size, p, False, True, True), **sw)
    for kind in moe_layer_pattern(cfg.model):
        if "layer" in sw.get("recompute", ()):  # whole-layer recompute: the layer input alone
            g, h = apply_switches(
                layer_recompute_saved(cfg.model, seq_length, micro_batch_size, p), offload=sw["offload"]
            )
        else:
            g, h = apply_switches(layer_saved(cfg.model, bool(kind), seq_length, micro_batch_size, p, False), **sw)
        gpu, host = gpu + g, host + h
    return gpu, host


CASES = [([], 128, 2), (["train.precision=bf16"], 128, 2), (ODD, 96, 2), (ODD + ["train.precision=bf16"], 256, 1)]


@pytest.mark.parametrize("overrides,seq,mbs", CASES, ids=["fp32", "bf16", "odd-fp32", "odd-bf16-s256"])
def test_activation_bytes_without_switches(megatron_world1, overrides, seq, mbs):
    measured, host = measure_saved_bytes(overrides, seq, mbs, meter=False)
    predicted, _ = predict_saved_bytes(overrides, seq, mbs)
    assert host == 0
    # the meter counts the same (to 0.1%: the plain count keys storages by address, so a saved tensor that
    # dies during the forward and whose memory a later one reuses is counted once)
    metered, metered_host = measure_saved_bytes(overrides, seq, mbs, meter=True)
    assert metered_host == 0 and metered == pytest.approx(measured, rel=1e-3)
    assert predicted == pytest.approx(measured, rel=0.15), (predicted, measured)


SWITCHES = [
    ["memory.fp8_store=[moe_fc1_input]"],
    ["memory.fp8_store=[swiglu_input]"],
    ["memory.recompute=[layernorm]"],
    ["memory.recompute=[swiglu]"],
    ["memory.recompute=[mla_up_proj]"],
    ["memory.recompute=[moe_down_proj]"],
    ["memory.offload=[attn_input,mla_up_proj,core_attn,attn_proj]"],
    ["memory.offload=[mlp_input,moe_fc1_input,swiglu_input,fc2_input]"],
    ["memory=k2"],
    ["memory.recompute=[layer]"],
    ["memory=k2", "memory.recompute=[layer]"],
]


_METERED: dict = {}


def metered(overrides: list[str], seq_length: int, micro_batch_size: int) -> dict:
    """:func:`measure_saved_bytes` through the meter, per site (``SavedBytesMeter.per_forward``); each
    shape's memory=none measured once per session."""
    key = (tuple(overrides), seq_length, micro_batch_size)
    if key not in _METERED:
        per = measure_saved_bytes(overrides, seq_length, micro_batch_size, per_site=True)
        _METERED[key] = per
    return _METERED[key]


def _shapes(switch: list[str]) -> list:
    return [(switch, 128, 2), (ODD + switch + ["train.precision=bf16"], 256, 1)]


@pytest.mark.parametrize("switch", SWITCHES, ids=lambda s: "+".join(x.split("=")[1] for x in s))
def test_activation_bytes_per_switch(megatron_world1, switch):
    """Each FP8-storage / recompute / offload switch: predicted device and host bytes within 10% of the
    measured ones; and what the switch changes against memory=none (device bytes dropped, host bytes added
    per offload site) within 10% of the measured change, so that a planner ignoring one switch fails even
    where the switch moves only a few percent of the total."""
    from k2.launcher.planning.activation_bytes import SITES

    for overrides, seq, mbs in _shapes(switch):
        none_overrides = [o for o in overrides if o not in switch]
        got, plain = metered(overrides, seq, mbs), metered(none_overrides, seq, mbs)
        predicted, predicted_plain = (
            predict_saved_bytes(overrides, seq, mbs),
            predict_saved_bytes(none_overrides, seq, mbs),
        )
        for what, m, p in zip(("device", "host"), (got["device_total"], got["host_total"]), predicted):
            assert p == pytest.approx(m, rel=0.10, abs=1024), (switch, what, p, m)
        dropped_m = plain["device_total"] - got["device_total"]
        dropped_p = predicted_plain[0] - predicted[0]
        assert dropped_m > 0 and dropped_p == pytest.approx(dropped_m, rel=0.10), (switch, dropped_p, dropped_m)
        for site in load_config(["model=k2_tiny", *overrides]).memory.offload or ():  # each site's host bytes
            assert site in SITES["offload"]
            site_p = predict_saved_bytes(overrides, seq, mbs, offload=[site])[1]
            site_m = got["host"].get(site, 0)
            assert site_p == pytest.approx(site_m, rel=0.10, abs=1024), (switch, site, site_p, site_m)


def test_switches_on_a_k2_moe_layer():
    """What each memory.* switch does to one K2 MoE layer's activations (4,096 tokens, BF16, GPU kernels),
    against closed forms written from docs/k2_reference.md's widths."""
    from k2.launcher.planning.activation_bytes import apply_switches, layer_saved

    m = load_config(["model=kimi_k2"]).model
    T, h, H, Tk = 4096, 7168, 64, 4096 * 8
    saved = layer_saved(m, True, 4096, 1, "bf16", True)
    none, _ = apply_switches(saved)
    # FP8 storage of the routed experts' input: 2 B -> 1 B + an FP32 scale per 128 elements
    fp8, _ = apply_switches(saved, fp8_store=["moe_fc1_input"])
    assert none - fp8 == pytest.approx(Tk * h * (2 - 1 - 4 / 128))
    # recomputing the MLA up-projections drops q, k, v (192 + 192 + 128 per head) and RoPE's cos and sin
    # tables for q and for k (BF16 [4096, 64] each, made inside the recomputed function); the fused norm's
    # saved input is the whole kv latent, so the checkpoint's rope-key view of it adds nothing
    rec, _ = apply_switches(saved, recompute=["mla_up_proj"])
    assert none - rec == pytest.approx(2 * T * H * (192 + 192 + 128) + 4 * 2 * 4096 * 64)
    # recomputing the MoE down-projection (K2's placement of the probability scaling after linear_fc2,
    # model/mlp.py) drops the routed experts' SwiGLU output before the scaling: [Tk, 2048] BF16
    down, _ = apply_switches(saved, recompute=["moe_down_proj"])
    assert none - down == pytest.approx(2 * Tk * 2048)
    # offloading core attention moves q, k, v, its output and log-sum-exp to the host
    gpu, host = apply_switches(saved, offload=["core_attn"])
    assert host == pytest.approx(2 * T * H * (192 + 192 + 128) + 2 * T * H * 128 + 4 * T * H)
    assert gpu + host == pytest.approx(none)
    # a recomputed tensor is neither stored nor offloaded
    gpu2, host2 = apply_switches(saved, recompute=["mla_up_proj"], offload=["core_attn"])
    assert host2 == pytest.approx(2 * T * H * 128 + 4 * T * H)
    # the whole K2 recipe keeps well under a tenth of it on the GPU
    k2 = load_config(["model=kimi_k2", "memory=k2"]).memory
    gpu_k2, host_k2 = apply_switches(saved, **{k: list(k2[k]) for k in ("fp8_store", "recompute", "offload")})
    assert gpu_k2 < none / 10 and gpu_k2 + host_k2 < none
    with pytest.raises(ValueError, match="memory.recompute"):
        apply_switches(saved, recompute=["attention"])
