"""sslkit.config.text: the YAML a run folder and every checkpoint hold reads back to the config it was made of."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from sslkit.config.compose import compose_config
from sslkit.config.text import config_yaml


def test_strings_that_look_like_other_types_read_back_as_strings() -> None:
    """OmegaConf reads ``1e-3``, ``true``, ``007``, ``0x10``, ``.inf``, ``~`` and ``null`` unquoted as numbers,
    booleans or None: written as strings they must come back as strings, and long or non-ASCII ones intact."""
    values = {"a": "1e-3", "b": "true", "c": "007", "d": "x: y", "e": "null", "f": "long " * 40, "g": "üñí",
              "h": [1, "2", 2.5, None, True], "i": "0x10", "j": ".inf", "k": "~", "m": {"n": "${a}"}}
    text = config_yaml(OmegaConf.create(values))
    back = OmegaConf.to_container(OmegaConf.create(text))
    assert back == {**values, "m": {"n": "1e-3"}}  # interpolations resolved
    assert "a: '1e-3'" in text and "g: üñí" in text


@pytest.mark.parametrize("recipe", ["simclr", "dinov3"])
def test_a_recipe_reads_back_equal_and_as_omegaconf_writes_it(recipe: str) -> None:
    cfg = compose_config([f"config={recipe}", "machine.device=cpu"])
    text = config_yaml(cfg)
    assert OmegaConf.create(text) == OmegaConf.create(OmegaConf.to_yaml(cfg, resolve=True))
    assert text == OmegaConf.to_yaml(cfg, resolve=True)  # the same text, by libyaml's emitter


def test_without_libyaml_it_is_omegaconfs_own_text(monkeypatch: pytest.MonkeyPatch) -> None:
    from sslkit.config import text

    cfg = compose_config(["config=simclr", "machine.device=cpu"])
    fast = config_yaml(cfg)
    monkeypatch.setattr(text, "_DUMPER", None)
    assert config_yaml(cfg) == fast == OmegaConf.to_yaml(cfg, resolve=True)
