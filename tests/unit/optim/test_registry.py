"""The optimizer registry (``k2.optim.registry``): every optimizer describes itself once, and the config,
the recipes, the trainer's builder and the planner agree with it."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from k2.config.recipes import RECIPES_DIR
from k2.config.schema import OptimConfig
from k2.config.validate import OPTIMIZERS
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
    assert flops == 4 * m * m * n + 2 * m ** 3
