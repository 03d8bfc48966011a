"""Values the docs state about recipes and defaults are the configs' values (a recipe change must reach the docs)."""

from __future__ import annotations

import re

from helpers import REPO

from sslkit.config.compose import compose_config


def _cfg(recipe: str):
    return compose_config([f"config={recipe}", "machine.device=cpu"])


def test_getting_started_describes_the_simclr_recipe_as_it_is() -> None:
    text = (REPO / "docs" / "getting_started.md").read_text()
    first_run = re.search(r"trains SimCLR \((.*?)\) on the", text, flags=re.S)
    assert first_run, "the first-run paragraph of docs/getting_started.md moved"
    said = first_run.group(1)
    cfg = _cfg("simclr")
    assert f"batch {cfg.data.batch_size}" in said
    assert f"T={cfg.loss.temperature:g}" in said
    assert cfg.model.trunk == "small_cnn" and "small CNN" in said
    knn = re.search(r"weighted kNN\s+\(k=(\d+), T=([0-9.]+)", text)
    assert knn and (int(knn.group(1)), float(knn.group(2))) == (cfg.eval.knn.k, cfg.eval.knn.temperature)


def test_config_reference_defaults_match_defaults_yaml() -> None:
    """Every `key` | default row of docs/configs.md's key reference holds the value of sslkit/config/defaults.yaml."""
    from omegaconf import OmegaConf

    from sslkit.config.schema import schema

    defaults = schema()
    rows = re.findall(r"^\| `([a-z_.]+)` \| ([^|]+) \|", (REPO / "docs" / "configs.md").read_text(), flags=re.M)
    checked = 0
    for key, shown in rows:
        value = OmegaConf.select(defaults, key, default=None)
        if value is None or OmegaConf.is_config(value):
            continue
        shown = shown.strip().strip("`")
        if isinstance(value, bool):
            assert shown == str(value).lower(), key
        elif isinstance(value, int | float):
            assert float(shown) == float(value), key
        elif isinstance(value, str) and value:
            assert shown == value, key
        checked += 1
    assert checked >= 10
