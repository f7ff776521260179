"""The optimizer registry (``k2.optim.registry``): every optimizer describes itself once, and the config,
the recipes, the trainer's builder and the planner agree with it."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from k2.config import load_config
from k2.config.recipes import RECIPES_DIR
from k2.config.schema import OptimConfig, optimizer_settings
from k2.config.validate import OPTIMIZER_CHECKS, OPTIMIZERS
from k2.launcher.planning.checkpoint import checkpoint_bytes
from k2.optim.registry import optimizer_names, optimizer_spec


def test_names_agree_with_config_and_recipes():
    """optim.name's allowed values, the optim recipe group and the registry are the same set."""
    recipes = {p.stem: yaml.safe_load(p.read_text())["name"] for p in (RECIPES_DIR / "optim").glob("*.yaml")}
    assert all(stem == name for stem, name in recipes.items())
    assert set(optimizer_names()) == set(OPTIMIZERS) == set(recipes)


def test_settings_are_optim_keys():
    """Each optimizer's own settings are keys of the ``optim`` section."""
    keys = {f.name for f in dataclasses.fields(OptimConfig)}
    for name in optimizer_names():
        assert set(optimizer_spec(name).settings) <= keys, name


def test_unknown_name_names_the_allowed_values():
    with pytest.raises(ValueError) as e:
        optimizer_spec("lamb")
    assert str(e.value) == f"optim.name='lamb'; allowed: {', '.join(optimizer_names())}"
    assert optimizer_names()[:2] == ("adamw", "muonclip")


def test_state_bytes_of_each_route():
    """The figures the planner prices (docs: AdamW's two FP32 moments and step counter, Muon's momentum)."""
    adamw, muonclip = optimizer_spec("adamw"), optimizer_spec("muonclip")
    routes = {r: (u.state_bytes, u.step_bytes) for r, u in muonclip.updates.items()}
    assert routes == {"adamw": (8, 4), "muon": (4, 0)}
    assert list(adamw.updates) == ["adamw"] and adamw.matrix_step is None
    assert muonclip.main_update.route == "muon" and muonclip.matrix_step.iterations == 5
    # BF16 weights (2 B) + FP32 master (4 B) + the states: 14 B per parameter with AdamW, 10 with MuonClip
    assert checkpoint_bytes(10, "adamw") == 140 and checkpoint_bytes(10, "muonclip") == 100


def test_newton_schulz_flops():
    """The GEMMs of one Newton-Schulz iteration on an [m, n] matrix are 4 m^2 n + 2 m^3 FLOPs."""
    m, n = 3, 7
    flops = sum(2 * a * k * b for a, k, b in optimizer_spec("muonclip").matrix_step.gemms(m, n))
    assert flops == 4 * m * m * n + 2 * m**3


@pytest.mark.parametrize(
    "overrides,dist_opt,want",
    [
        (["optim=adamw"], True, (False, False, False)),
        (["optim=muonclip"], False, (True, False, False)),
        (["optim=muonclip"], True, (True, True, False)),
        (["optim=muonclip", "optim.muon_zero1=layer_wise"], True, (True, True, True)),
        (["optim=muonclip", "optim.muon_zero1=layer_wise"], False, (True, False, False)),
    ],
)
def test_placement_follows_the_optimizer_and_zero1(overrides, dist_opt, want):
    """Where the parameters go (the trainer's builder and the planner both read it): Muon matrices only
    under MuonClip, in buffers of their own only under ZeRO-1, layer-wise only when asked for."""
    cfg = load_config(overrides)
    place = optimizer_spec(cfg.optim.name).placement(cfg.optim, dist_opt)
    assert (place.muon, place.zero1_muon, place.layer_wise) == want
    assert place.router_optimizer == "muon"


def test_muonclip_settings_are_declared_once():
    """MuonClip's own keys are the schema's (``_own("muonclip", ...)``); the ones megatron's OptimizerConfig
    also has reach it by name, every ``muon_*`` key but the ZeRO-1 layout; the check of those keys is found in
    the one table of optimizer checks, which has an entry for each optimizer with keys of its own."""
    from k2.optim.build import _megatron_muon_settings

    spec = optimizer_spec("muonclip")
    assert spec.settings == optimizer_settings("muonclip") and "muon_momentum" in spec.settings
    assert optimizer_spec("adamw").settings == ()
    passed = _megatron_muon_settings(load_config(["optim=muonclip", "optim.muon_momentum=0.9"]).optim)
    assert set(passed) == {k for k in spec.settings if k.startswith("muon_")} - {"muon_zero1"}
    assert passed["muon_momentum"] == 0.9
    assert set(OPTIMIZER_CHECKS) == {n for n in optimizer_names() if optimizer_spec(n).settings}
