"""The recipe diff: what a run's config changes from its recipe, for the log, the report and the run folder's name."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sslkit.config.compose import hydra_compose, resolve_method
from sslkit.config.schema import (
    GROUPS,
    defaults_file,
)
from sslkit.config.secrets import hidden_value

__all__ = ["ABSENT", "flatten_config", "format_recipe_diff", "group_choices", "recipe_diff", "show_value"]

class _Absent:
    """The value :func:`recipe_diff` gives a key that one side does not have."""

    def __repr__(self) -> str:
        return "(not set)"


#: A key that the recipe or the run does not have, in :func:`recipe_diff`'s tuples.
ABSENT: Any = _Absent()


#: Keys that every run sets for itself: not a change from the recipe.
_OWN_KEYS = ("name", "output_dir")


def group_choices(overrides: list[str]) -> dict[str, str]:
    """The recipe and data preset a run uses: ``config=``/``data=`` of ``overrides``, else the defaults."""
    choices: dict[str, str] = {}
    for item in defaults_file().defaults:
        if isinstance(item, DictConfig):
            choices.update({str(k): str(v) for k, v in item.items()})
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if sep and key in GROUPS:
            choices[key] = value
    return choices


def flatten_config(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": 1, "c": [1, 2]}`` (lists are values; empty dicts vanish)."""
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(flatten_config(value, f"{prefix}{key}."))
    return flat


def recipe_diff(overrides: list[str], cfg: DictConfig) -> list[tuple[str, Any, Any]]:
    """What a run changed from its recipe and data preset: ``(key, recipe value, run value)`` for every
    dotted key (lists compared whole) whose resolved value differs between the config composed from
    the ``config=``/``data=`` overrides alone and ``cfg``; a key only one side has gets :data:`ABSENT`
    on the other. ``name`` and ``output_dir`` are not changes. Nothing is imported or validated."""
    groups = [ov for ov in overrides if ov.partition("=")[0] in GROUPS]
    composed = hydra_compose(groups)
    OmegaConf.set_struct(composed, False)
    resolve_method(composed)  # the names the method fills in are the recipe's, not the run's changes
    recipe = flatten_config(OmegaConf.to_container(composed, resolve=True))
    run = flatten_config(OmegaConf.to_container(cfg, resolve=True))
    diffs = []
    for key in dict.fromkeys([*run, *recipe]):
        if key in _OWN_KEYS:
            continue
        before, after = recipe.get(key, ABSENT), run.get(key, ABSENT)
        if not _same(before, after):
            diffs.append((key, before, after))
    return diffs


def _same(a: Any, b: Any) -> bool:
    """Equal values (1 and 1.0 are; true and 1 are not; a key that is absent equals nothing)."""
    if a is ABSENT or b is ABSENT:
        return False
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def show_value(value: Any) -> str:
    """A value as it would be typed on the command line (yaml flow style: true, null, [0.9, 0.99])."""
    if value is ABSENT:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(show_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value) if value != "" else "''"


def format_recipe_diff(overrides: list[str], cfg: DictConfig) -> str:
    """A short account of a run's config for its log: recipe, data preset, and each key changed from them
    (one per line, ``key recipe_value -> value``), or ``as the recipe``; the full config is in
    ``<output_dir>/config.yaml``."""
    choices = group_choices(overrides)
    head = f"config: recipe {choices.get('config', '?')}, data {choices.get('data', '?')}"
    where = os.path.join(str(cfg.output_dir), "config.yaml")
    diffs = recipe_diff(overrides, cfg)
    if not diffs:
        return f"{head}, as the recipe (the full config is in {where})"
    lines = [f"  {key} {show_value(hidden_value(key, before))} -> {show_value(hidden_value(key, after))}"
             for key, before, after in diffs]
    return "\n".join([f"{head}; changed from them:", *lines, f"(the full config is in {where})"])
