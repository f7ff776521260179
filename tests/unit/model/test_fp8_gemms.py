"""train.fp8_recipe (model/fp8.py, model/backends.py, config/validate.py): the GEMMs in FP8 through
Transformer Engine. On CPU: the settings refuse what cannot run in one line, the TransformerConfig fields,
and the layer spec's linears swapped (stand-in classes for TE's, which this machine does not have)."""

from __future__ import annotations

import pytest

from k2.config import ConfigError, load_config
from k2.model.backends import check_fp8_recipe
from k2.model.fp8 import fp8_fields, swap_linears


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (
            ["train.fp8_recipe=mxfp8"],
            ["train.fp8_recipe=mxfp8", "train.precision=fp32", "allowed: train.precision=bf16"],
        ),
        (["train.fp8_recipe=fp4", "train.precision=bf16"], ["train.fp8_recipe='fp4'", "allowed: blockwise, mxfp8"]),
    ],
)
def test_a_bad_fp8_recipe_is_one_line(overrides, needles):
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)


def test_the_machine_check_names_what_is_missing():
    """Without CUDA or Transformer Engine, one line saying so (k2-plan still prices it); MXFP8 needs
    Blackwell (10.x), blockwise Hopper; K2's grouped experts (torch._grouped_mm) are not reached by TE."""
    cfg = load_config(["train.fp8_recipe=mxfp8", "train.precision=bf16", "model.moe_grouped_gemm=false"])
    with pytest.raises(ConfigError, match=r"lacks a CUDA device and Transformer Engine .*train.fp8_recipe=null"):
        check_fp8_recipe(cfg, cuda=False, te=False)
    with pytest.raises(ConfigError, match=r"lacks Transformer Engine"):
        check_fp8_recipe(cfg, cuda=True, te=False)
    with pytest.raises(
        ConfigError,
        match=r"compute capability 10.0 or later, this one is 9.x; allowed here: "
        r"blockwise, null",
    ):
        check_fp8_recipe(cfg, cuda=True, te=True, capability=9)
    check_fp8_recipe(cfg, cuda=True, te=True, capability=10)
    grouped = load_config(["train.fp8_recipe=blockwise", "train.precision=bf16", "model.moe_grouped_gemm=true"])
    with pytest.raises(ConfigError, match="model.moe_grouped_gemm=false"):
        check_fp8_recipe(grouped, cuda=True, te=True, capability=9)
    check_fp8_recipe(load_config([]), cuda=False, te=False)  # (no recipe: nothing to check)


def test_fp8_fields_name_the_format_the_recipe_and_the_padding():
    assert fp8_fields(None, moe=True) == {}
    assert fp8_fields("mxfp8", moe=True) == {
        "fp8": "e4m3",
        "fp8_recipe": "mxfp8",
        "moe_router_padding_for_quantization": True,
    }
    assert fp8_fields("blockwise", moe=False) == {"fp8": "e4m3", "fp8_recipe": "blockwise"}


def test_every_linear_of_the_k2_layer_spec_is_swapped_and_nothing_else():
    """K2's MoE and dense layer specs (megatron's local spec with K2's modules): each ColumnParallelLinear /
    RowParallelLinear -- MLA's five projections, the dense, shared-expert and routed-expert fc1 / fc2 -- becomes
    the stand-in class; the norms, core attention and router stay."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from k2.model.build import decoder_block_spec, transformer_config
    from k2.parallel.dims import ParallelDims

    class Col:  # (stand-ins for Transformer Engine's TEColumnParallelLinear / TERowParallelLinear)
        pass

    class Row:
        pass

    cfg = load_config(["model.num_layers=2"])
    tcfg = transformer_config(cfg, ParallelDims.from_config(cfg.parallel, cfg.model, 1))
    block = decoder_block_spec(tcfg, None, 0, True)

    def found(spec, out, seen=None):
        """Every class the spec names (walking what swap_linears walks)."""
        import dataclasses
        from functools import partial

        from megatron.core.transformer.spec_utils import ModuleSpec

        if isinstance(spec, type):
            out.append(spec)
        elif isinstance(spec, ModuleSpec):
            found(spec.module, out), found(spec.submodules, out)
        elif isinstance(spec, partial):
            found(spec.func, out)
            for x in (*spec.args, *spec.keywords.values()):
                found(x, out)
        elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
            for f in dataclasses.fields(spec):
                found(getattr(spec, f.name), out)
        return out

    for layer in block.layer_specs:
        before = found(layer, [])
        after = found(swap_linears(layer, {ColumnParallelLinear: Col, RowParallelLinear: Row}), [])
        assert before.count(ColumnParallelLinear) >= 5 and before.count(RowParallelLinear) >= 2
        assert after.count(Col) == before.count(ColumnParallelLinear)
        assert after.count(Row) == before.count(RowParallelLinear)
        assert ColumnParallelLinear not in after and RowParallelLinear not in after
        assert [c for c in after if c not in (Col, Row)] == [
            c for c in before if c not in (ColumnParallelLinear, RowParallelLinear)
        ]
