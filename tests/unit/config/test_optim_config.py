"""optim=adamw | muonclip as Hydra choices: which model gets which by default, and bad MuonClip settings
failing before any process group with one message naming the setting and its allowed values."""

from __future__ import annotations

import pytest

from k2.config.load import load_config
from k2.launcher import train


@pytest.mark.parametrize(
    "overrides, model, optim, tau",
    [
        ([], "k2_tiny", "adamw", None),  # CPU proxy: AdamW unless asked (docs/optimizer.md)
        (["optim=muonclip"], "k2_tiny", "muonclip", 100.0),
        (["model=kimi_k2"], "kimi_k2", "muonclip", 100.0),  # the K2 recipe: MuonClip by default
        (["model=kimi_k2", "optim=adamw"], "kimi_k2", "adamw", None),  # the command line wins
    ],
)
def test_optimizer_choice_per_model(overrides, model, optim, tau):
    cfg = load_config(overrides)
    assert (cfg.model.name, cfg.optim.name, cfg.optim.qk_clip_tau) == (model, optim, tau)
    if optim == "muonclip":  # K2's values (docs/k2_reference.md "Optimizer")
        o = cfg.optim
        assert (o.muon_momentum, o.muon_nesterov, o.muon_num_ns_steps, o.muon_coefficient_type) == (
            0.95,
            True,
            5,
            "simple",
        )
        assert (o.muon_scale_mode, o.muon_extra_scale_factor, o.muon_fp32_matmul_prec) == ("spectral", 0.2, "medium")
        assert (o.adam_beta1, o.adam_beta2) == (0.9, 0.95)


CASES = {
    "unknown_optimizer": (["optim=lion"], ["optim/lion", "adamw", "muonclip"]),
    "ns_coefficients": (
        ["optim=muonclip", "optim.muon_coefficient_type=cubic"],
        ["optim.muon_coefficient_type", "simple"],
    ),
    "ns_steps": (["optim=muonclip", "optim.muon_num_ns_steps=0"], ["optim.muon_num_ns_steps", ">= 1"]),
    "momentum": (["optim=muonclip", "optim.muon_momentum=1.5"], ["optim.muon_momentum", "< 1"]),
    "ns_precision": (
        ["optim=muonclip", "optim.muon_fp32_matmul_prec=low"],
        ["optim.muon_fp32_matmul_prec", "medium", "highest"],
    ),
    "negative_tau": (["optim=muonclip", "optim.qk_clip_tau=-1"], ["optim.qk_clip_tau", "> 0", "null"]),
    "tau_without_max_logits": (
        ["optim=muonclip", "model.record_max_logits=false"],
        ["optim.qk_clip_tau", "model.record_max_logits"],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_optim_setting_fails_before_any_process_group(name, tmp_path, capsys, no_process_start):
    overrides, must_name = CASES[name]
    started = no_process_start
    rc = train.main([*overrides, f"run.dir={tmp_path / 'run'}", "run.wandb.mode=disabled"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("k2-train: error:")]
    assert rc == 2 and len(lines) == 1, err
    for word in must_name:
        assert word in lines[0], (word, lines[0])
    assert started == []
