"""The fixed-choice settings (k2.config.choices): their allowed values are written once, as the schema field's
Enum type, and read everywhere as the plain string they were before."""

from __future__ import annotations

import json

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf._utils import is_structured_config
from omegaconf.errors import ValidationError
from omegaconf.nodes import EnumNode

from k2.config import ConfigError, load_config, to_yaml
from k2.config.choices import CHOICES, AttentionBackend, Choice, Precision, allowed, choice_error
from k2.config.load import _choice_refused
from k2.config.schema import K2Config, PhaseConfig


def _enum_fields(node: DictConfig, prefix: str = "") -> dict[str, type]:
    """Every Enum-typed field of the schema, by dotted key (a list's items: ``<key>.<i>.``)."""
    out = {}
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, ListConfig) and is_structured_config(child._metadata.element_type):
            out.update(_enum_fields(OmegaConf.structured(child._metadata.element_type), f"{prefix}{key}.<i>."))
        elif isinstance(child, DictConfig):
            out.update(_enum_fields(child, f"{prefix}{key}."))
        elif isinstance(child, EnumNode):
            out[f"{prefix}{key}"] = child.enum_type
    return out


def test_every_enum_field_has_its_message_and_its_values_once():
    fields = _enum_fields(OmegaConf.structured(K2Config))
    assert {k: CHOICES[k][0] for k in fields} == fields  # the table and the schema name the same Enums
    assert set(CHOICES) == set(fields)
    for choice in set(fields.values()):
        assert issubclass(choice, Choice)
        # OmegaConf assigns an Enum field by member name: each name must be the value a recipe writes
        assert [m.name for m in choice] == [m.value for m in choice], choice


def test_a_value_outside_the_enum_is_the_settings_one_error():
    schema = OmegaConf.structured(K2Config)
    schema.schedule.phases = [PhaseConfig()]  # a list item's setting: schedule.phases.<i>.<key>
    for setting in sorted(CHOICES):  # OmegaConf's refusal as load_config maps it (cheap: no Hydra compose)
        with pytest.raises(ValidationError) as e:
            OmegaConf.update(schema, setting.replace("<i>", "0"), "bogus")
        refused = _choice_refused(e.value)
        key = setting.replace(".<i>", "[0]")  # as OmegaConf names a list item ...
        assert refused is not None and str(refused) == str(choice_error(key, "bogus"))
        named = setting.replace("<i>", "0")  # ... and the error as the override is written
        assert f"{named}='bogus'" in str(refused) and allowed(CHOICES[setting][0]) in str(refused)
    for setting in ("output", "optim.muon_zero1", "model.rope_type"):  # and through a Hydra override
        with pytest.raises(ConfigError) as e:
            load_config([f"{setting}=bogus"])
        assert str(e.value) == str(choice_error(setting, "bogus"))


def test_an_enum_value_reads_as_the_plain_string():
    cfg = load_config(["train.precision=bf16", "model.attention_backend=sdpa"])
    p = cfg.train.precision
    assert p is Precision.bf16 and cfg.model.attention_backend is AttentionBackend.sdpa
    assert p == "bf16" and f"{p}" == "bf16" and repr(p) == "'bf16'" and {"bf16": 1}[p] == 1
    assert "precision: bf16\n" in to_yaml(cfg)  # <run.dir>/config.yaml, compared on resume
    assert json.loads(json.dumps(OmegaConf.to_container(cfg, resolve=True)))["train"]["precision"] == "bf16"
    saved = OmegaConf.to_container(OmegaConf.create(to_yaml(cfg)), resolve=True)
    assert saved == OmegaConf.to_container(cfg, resolve=True)  # a saved config equals the live one


@pytest.mark.parametrize("setting", ["schedule.phases.1.lr_style", "schedule.phases.0.rope_type"])
def test_a_schedule_phase_setting_outside_its_enum_is_one_line_naming_it(setting):
    """``lr_style`` and ``rope_type`` of a phase (a list item) are refused while the config is composed, in
    one line that names the phase's setting and every allowed value."""
    with pytest.raises(ConfigError) as e:
        load_config(["schedule=tiny_wsd", f"{setting}=bogus"])
    msg = str(e.value)
    choice = CHOICES[setting.replace(".1.", ".<i>.").replace(".0.", ".<i>.")][0]
    assert "\n" not in msg and msg.startswith(setting + "='bogus'")  # named as the override is written
    assert f"allowed: {allowed(choice)}" in msg
