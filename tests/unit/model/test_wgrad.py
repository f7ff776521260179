"""model/wgrad.py: the split backward of megatron's linear layers (dgrad now, wgrad queued), against
plain torch and megatron's own linear function; the DDP hook point; saved-tensor hooks; the queue's
accounting. (The schedule side and the multi-rank equality: tests/integration/test_pipeline_wgrad.py.)"""

from __future__ import annotations

import pytest
import torch

from k2.model.wgrad import WgradStore, check_ddp_hooks, decouple_linear_wgrad, decoupled_modules


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )


class _Block(torch.nn.Module):
    """A column- then a row-parallel linear, under ``decoder.layers.0`` like a GPT layer's MLP."""

    def __init__(self, bias: bool = False):
        super().__init__()
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        cfg = _config()
        init = torch.nn.init.normal_
        fc1 = ColumnParallelLinear(
            16, 24, config=cfg, init_method=init, bias=bias, gather_output=False, skip_bias_add=False
        )
        fc2 = RowParallelLinear(
            24, 16, config=cfg, init_method=init, bias=False, input_is_parallel=True, skip_bias_add=True
        )
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.decoder.layers[0].fc1, self.decoder.layers[0].fc2 = fc1, fc2
        self.head = ColumnParallelLinear(16, 8, config=cfg, init_method=init, bias=False, gather_output=False)

    def forward(self, x):
        layer = self.decoder.layers[0]
        h, _ = layer.fc1(x)
        y, _ = layer.fc2(torch.nn.functional.silu(h))
        out, _ = self.head(y)
        return out


def _reference_grads(block, x, dy):
    """Gradients of the same computation in plain torch (F.linear), from copies of the weights."""
    layer = block.decoder.layers[0]
    w1 = layer.fc1.weight.detach().clone().requires_grad_()
    b1 = layer.fc1.bias.detach().clone().requires_grad_() if layer.fc1.bias is not None else None
    w2 = layer.fc2.weight.detach().clone().requires_grad_()
    wh = block.head.weight.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    h = torch.nn.functional.linear(xr, w1, b1)
    y = torch.nn.functional.linear(torch.nn.functional.silu(h), w2)
    torch.nn.functional.linear(y, wh).backward(dy)
    return xr.grad, w1.grad, None if b1 is None else b1.grad, w2.grad, wh.grad


@pytest.mark.parametrize("bias", [False, True])
def test_dgrad_now_wgrad_after_drain_equal_plain_torch(megatron_world1, bias):
    torch.manual_seed(0)
    block = _Block(bias=bias)
    store = WgradStore()
    mods = decouple_linear_wgrad([block], store)
    layer = block.decoder.layers[0]
    assert mods == [layer.fc1, layer.fc2]  # the head (outside decoder.layers) keeps its backward
    x = torch.randn(5, 3, 16, requires_grad=True)  # [s, b, h] as megatron passes it
    dy = torch.randn(5, 3, 8)
    ref_x, ref_w1, ref_b1, ref_w2, ref_wh = _reference_grads(block, x, dy)

    block(x).backward(dy)
    # B: the input gradient is complete, the decoupled weights have none yet, the head has its own
    torch.testing.assert_close(x.grad, ref_x, rtol=1e-6, atol=1e-6)
    assert layer.fc1.weight.grad is None and layer.fc2.weight.grad is None
    torch.testing.assert_close(block.head.weight.grad, ref_wh, rtol=1e-6, atol=1e-6)
    assert len(store) == 2 and store.held_bytes == 5 * 3 * (16 + 24) * 4 + 5 * 3 * (24 + 16) * 4
    # W
    assert store.drain() == 2 and len(store) == 0 and store.held_bytes == 0
    torch.testing.assert_close(layer.fc1.weight.grad, ref_w1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.fc2.weight.grad, ref_w2, rtol=1e-6, atol=1e-6)
    if bias:
        torch.testing.assert_close(layer.fc1.bias.grad, ref_b1, rtol=1e-6, atol=1e-6)
        assert layer.fc1.bias.skip_backward_post_hook


def test_bitwise_equal_to_megatron_linear_and_accumulates_over_microbatches(megatron_world1):
    """Two microbatches accumulate into the same gradient as megatron's own linear function, bit for bit."""
    torch.manual_seed(1)
    ref, split = _Block(), _Block()
    split.load_state_dict(ref.state_dict())
    store = WgradStore()
    decouple_linear_wgrad([split], store)
    for _mb in range(2):
        x = torch.randn(4, 2, 16)
        dy = torch.randn(4, 2, 8)
        ref(x.clone().requires_grad_()).backward(dy)
        split(x.clone().requires_grad_()).backward(dy)
        store.drain()
    for (n, a), (_, b) in zip(ref.named_parameters(), split.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_saved_tensor_hooks_apply_to_the_stored_input(megatron_world1):
    """The input is saved for backward through the active saved-tensor hooks (FP8 storage / offload use
    them): here a lossy bf16 pack; the deferred wgrad uses the unpacked tensor, exactly as megatron's
    linear does under the same hooks."""
    torch.manual_seed(2)
    ref, split = _Block(), _Block()
    split.load_state_dict(ref.state_dict())
    store = WgradStore()
    decouple_linear_wgrad([split], store)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.to(torch.bfloat16)

    def unpack(t):
        return t.to(torch.float32)

    x = torch.randn(4, 2, 16)
    dy = torch.randn(4, 2, 8)
    for model in (ref, split):
        packed.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = model(x.clone().requires_grad_())
        out.backward(dy)
        assert torch.Size([4, 2, 16]) in packed  # fc1's input went through the pack hook
    store.drain()
    layer_r, layer_s = ref.decoder.layers[0], split.decoder.layers[0]
    assert torch.equal(layer_s.fc1.weight.grad, layer_r.fc1.weight.grad)
    # the hooks were not a no-op: without them (exact fp32 input) the deferred gradient differs
    plain = _Block()
    plain.load_state_dict(ref.state_dict())
    decouple_linear_wgrad([plain], store)
    plain(x.clone().requires_grad_()).backward(dy)
    store.drain()
    assert not torch.equal(plain.decoder.layers[0].fc1.weight.grad, layer_s.fc1.weight.grad)


def test_ddp_hook_point_runs_after_wgrad(megatron_world1):
    """megatron DDP registers the grad-ready hooks of parameters marked skip_backward_post_hook on the
    module (ddp_config.delay_wgrad_compute); they run after the deferred wgrad, with param.grad set."""
    torch.manual_seed(3)
    block = _Block()
    store = WgradStore()
    decouple_linear_wgrad([block], store)
    layer = block.decoder.layers[0]
    with pytest.raises(RuntimeError, match="delay_wgrad_compute"):
        check_ddp_hooks([block])  # no DDP yet: the deferred gradients would be lost
    main_grad = torch.zeros_like(layer.fc1.weight)
    seen = []

    def hook():  # what megatron's DDP hook does: main_grad += grad; grad = None
        seen.append(layer.fc1.weight.grad is not None)
        main_grad.add_(layer.fc1.weight.grad)
        layer.fc1.weight.grad = None

    layer.fc1.register_wgrad_accumulation_and_reduce_hooks(hook)
    layer.fc2.register_wgrad_accumulation_and_reduce_hooks(lambda: None)
    assert check_ddp_hooks([block]) == 2
    x = torch.randn(3, 2, 16, requires_grad=True)
    block(x).sum().backward()
    assert seen == []  # not before W
    store.drain()
    assert seen == [True] and layer.fc1.weight.grad is None and main_grad.abs().sum() > 0


def test_real_megatron_ddp_accumulates_deferred_wgrad_into_main_grad(megatron_world1):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    torch.manual_seed(4)
    ref, split = _Block(), _Block()
    split.load_state_dict(ref.state_dict())
    store = WgradStore()
    decouple_linear_wgrad([split], store)
    cfg = _config()
    ddp = {
        k: DistributedDataParallel(
            config=cfg,
            module=m,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, delay_wgrad_compute=(k == "split")),
        )
        for k, m in (("ref", ref), ("split", split))
    }
    assert check_ddp_hooks([ddp["split"]]) == 2
    x, dy = torch.randn(4, 2, 16), torch.randn(4, 2, 8)
    for k in ("ref", "split"):
        ddp[k](x.clone().requires_grad_()).backward(dy)
    assert split.decoder.layers[0].fc1.weight.main_grad.abs().sum() == 0  # W not run yet
    store.drain()
    for (n, a), (_, b) in zip(ref.named_parameters(), split.named_parameters()):
        assert torch.equal(a.main_grad, b.main_grad), n
        assert b.grad is None


def test_store_accounting():
    """Peak bytes and how many microbatches' items were queued at once."""

    class Mod:
        _k2_wgrad_hooks = ()

    store = WgradStore()
    w = torch.zeros(3, 2)
    from k2.model.wgrad import WgradItem

    def item(tag):
        return WgradItem(Mod(), w, None, torch.ones(4, 2), torch.ones(4, 3), False, tag)

    drained = []
    store.on_drain = lambda tags, n, nbytes, s, e, where: drained.append((tags, n, nbytes, where))
    store.put(item((0, 0)))
    store.put(item((0, 0)))
    assert store.held_bytes == store.peak_bytes == 2 * (8 + 12) * 4 and store.max_tags_held == 1
    store.drain("after_send")
    assert drained == [([(0, 0)], 2, 160, "after_send")]
    assert torch.equal(w.grad, 2 * torch.ones(4, 3).t() @ torch.ones(4, 2))
    store.reset_peak()
    store.put(item((0, 1)))
    store.put(item((1, 1)))
    assert store.max_tags_held == 2 and store.peak_bytes == 160
    store.drain()
    assert store.held_bytes == 0 and len(store) == 0
    assert decoupled_modules([torch.nn.Linear(2, 2)]) == []
