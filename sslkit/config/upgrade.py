"""A config saved by an earlier sslkit (a checkpoint's, a run folder's) made today's: renamed keys moved to their
new names, so that a run trained before a rename can still be evaluated, distilled from or exported."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from sslkit.errors import RENAMED

__all__ = ["upgrade_saved"]

#: Keys of ``model.freeze``'s entries renamed with :data:`~sslkit.errors.RENAMED` (``updates`` -> ``steps``).
FREEZE_RENAMED = {"updates": "steps"}


def upgrade_saved(saved: DictConfig) -> tuple[DictConfig, list[str]]:
    """``saved`` with every key whose last part was renamed (:data:`~sslkit.errors.RENAMED`, in any section; and
    ``model.freeze``'s entries' ``updates``) under its new name, values as written (interpolations unresolved), and
    the old dotted names moved, in order. A key whose new name is there too is left for validation to report (the
    two could disagree)."""
    tree = OmegaConf.to_container(saved, resolve=False)
    assert isinstance(tree, dict)
    moved: list[str] = []
    _walk(tree, "", moved)
    freeze = tree.get("model", {}).get("freeze") if isinstance(tree.get("model"), dict) else None
    for i, entry in enumerate(freeze if isinstance(freeze, list) else []):
        if isinstance(entry, dict):
            _rename(entry, f"model.freeze[{i}].", FREEZE_RENAMED, moved)
    return (OmegaConf.create(tree) if moved else saved), moved


def _walk(node: dict[str, Any], prefix: str, moved: list[str]) -> None:
    """:func:`_rename` by :data:`~sslkit.errors.RENAMED` in ``node`` and every mapping below it."""
    _rename(node, prefix, RENAMED, moved)
    for key, child in node.items():
        if isinstance(child, dict):
            _walk(child, f"{prefix}{key}.", moved)


def _rename(node: dict[str, Any], prefix: str, renames: dict[str, str], moved: list[str]) -> None:
    """Move ``node``'s keys named in ``renames``, or ending in ``_`` and one of them (``gram_start_update``, the
    loss's argument), to their new names, in place."""
    for key in list(node):
        for old, new in renames.items():
            if key == old or key.endswith(f"_{old}"):
                renamed = key[: len(key) - len(old)] + new
                if renamed not in node:
                    node[renamed] = node.pop(key)
                    moved.append(f"{prefix}{key}")
                break
