"""k2-convert against transformers and the trainer: checkpoints written by real runs (``cpu4`` = PP2 x
VPP2 x EP2 x DP2 after a switch to YaRN, and 1 rank with plain RoPE) exported to HF directories that
``transformers``' ``DeepseekV3ForCausalLM`` loads and that give our model's logits; HF -> ours (``cpu4``)
-> HF bit for bit; and runs started from an imported checkpoint at 1 rank and at ``cpu4`` with the same
losses; ``checkpoint.export_hf=true`` exports at the end of a run.

Trainer launches: 3 (a cpu4 run of 2 steps, then a 1-rank and a cpu4 run of 3 steps from the import);
everything else runs in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.distributed import run_trainer

#: cpu4 run whose step 2 is trained with YaRN: warmup of 1 step, then YaRN from the stable phase on
YARN_SWITCH = [
    "parallel=cpu4",
    "train.iters=2",
    "train.eval_interval=0",
    "schedule.phases.0.steps=1",
    "schedule.phases.1.rope_type=yarn",
    "run.seed=11",
]
FROM_IMPORT = ["train.iters=3", "train.eval_interval=0", "schedule.phases.0.steps=0"]


def _our_logits(ckpt: Path, tokens: torch.Tensor, rope_type: str) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` of our model (1 rank) with the weights of ``ckpt`` (any layout)."""
    from omegaconf import OmegaConf

    from k2.launcher.checkpointing.loading import load_model_weights
    from k2.model.build import build_model_chunks, transformer_config
    from k2.parallel.dims import ParallelDims

    cfg = OmegaConf.load(ckpt / "config.yaml")
    cfg.parallel = OmegaConf.create(
        {
            "name": "single",
            "tp": 1,
            "pp": 1,
            "vpp": None,
            "ep": 1,
            "layout": None,
            "first_stage_layers": None,
            "last_stage_layers": None,
            "use_distributed_optimizer": True,
        }
    )
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    chunks = build_model_chunks(cfg, dims, transformer_config(cfg, dims, rope_type=rope_type))
    load_model_weights(ckpt, chunks)
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return chunks[0].eval()(tokens, pos, None)


def _hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        return model.eval()(tokens).logits


def _assert_same_logits(ckpt: Path, hf_dir: Path, rope_type: str) -> None:
    """Max |ours - transformers'| relative to the largest |logit| is <= 1e-4, on 2 x 96 random tokens;
    our model with the other RoPE variant is 10x the tolerance away (the check tells them apart)."""
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (2, 96), generator=torch.Generator().manual_seed(3))
    ours, theirs = _our_logits(ckpt, tokens, rope_type), _hf_logits(hf_dir, tokens)
    scale = theirs.abs().max()
    rel = float((ours - theirs).abs().max() / scale)
    assert rel <= 1e-4, rel
    other = _our_logits(ckpt, tokens, "rope" if rope_type == "yarn" else "yarn")
    assert float((other - theirs).abs().max() / scale) > 1e-3  # 10x the tolerance (measured: 4e-3 .. 0.13)


def _tensors(hf_dir: Path) -> dict:
    from safetensors import safe_open

    weight_map = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    return {n: safe_open(str(hf_dir / f), framework="pt").get_tensor(n) for n, f in weight_map.items()}


def _model_keys(ckpt: Path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return {
        k: tuple(getattr(v, "size", ()))
        for k, v in md.items()
        if k.split(".")[0] in ("embedding", "decoder", "output_layer")
    }


@pytest.fixture(scope="module")
def yarn_cpu4_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("hf") / "yarn_cpu4"
    run_trainer(YARN_SWITCH, 4, run)
    return run / "checkpoints" / "iter_0000002"


def test_export_import_round_trip_and_training_from_an_import(yarn_cpu4_run, tmp_path, megatron_world1):
    from k2.config.load import load_config
    from k2.launcher.hf.export import export_hf
    from k2.launcher.hf.importer import import_hf

    # ours (saved at cpu4, trained with YaRN at its step) -> HF: transformers gives our logits
    hf = tmp_path / "hf_cpu4"
    report = export_hf(yarn_cpu4_run, hf, shard_bytes=1 << 20)
    config = json.loads((hf / "config.json").read_text())
    assert config["rope_scaling"] == {
        "type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    assert (config["architectures"], config["model_type"], config["rope_theta"]) == (
        ["DeepseekV3ForCausalLM"],
        "deepseek_v3",
        50000.0,
    )
    assert (config["n_group"], config["topk_group"], config["first_k_dense_replace"]) == (1, 1, 1)
    assert (
        report.shards > 1
        and len(set(json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"].values()))
        == report.shards
    )
    _assert_same_logits(yarn_cpu4_run, hf, "yarn")

    # HF -> ours at cpu4 -> HF: bit for bit, and the same megatron keys as the trainer's checkpoint
    cfg = load_config(["parallel=cpu4", f"run.dir={tmp_path / 'imported'}"])
    imported = import_hf(hf, cfg, world_size=4).checkpoint
    assert _model_keys(imported) == _model_keys(yarn_cpu4_run)
    again = tmp_path / "hf_again"
    export_hf(imported, again, shard_bytes=1 << 20)
    first, second = _tensors(hf), _tensors(again)
    assert set(first) == set(second)
    for name, x in first.items():
        assert x.dtype == second[name].dtype and torch.equal(x, second[name]), name

    # k2-train from the import at 1 rank and at cpu4: a fresh run (step 0), the same losses
    runs = {}
    for layout, nproc in (("single", 1), ("cpu4", 4)):
        export = ["checkpoint.export_hf=true"] if layout == "single" else []
        runs[layout] = run_trainer(
            [f"parallel={layout}", f"resume.from={imported}", *FROM_IMPORT, *export],
            nproc,
            tmp_path / f"from_import_{layout}",
        )
    for layout in runs:
        assert [r["step"] for r in runs[layout]] == [1, 2, 3]
    single, cpu4 = ([r["loss"] for r in runs[k]] for k in ("single", "cpu4"))
    assert single == pytest.approx(cpu4, rel=1e-5), (single, cpu4)
    assert len(set(single)) == 3  # the weights changed between steps

    # ours saved at 1 rank (plain RoPE), exported at the end of its run (checkpoint.export_hf=true) ->
    # transformers gives our logits
    ckpt_1 = tmp_path / "from_import_single" / "checkpoints" / "iter_0000003"
    hf_1 = tmp_path / "from_import_single" / "hf" / "iter_0000003"
    assert not (tmp_path / "from_import_cpu4" / "hf").exists()
    assert json.loads((hf_1 / "config.json").read_text())["rope_scaling"] is None
    _assert_same_logits(ckpt_1, hf_1, "rope")
