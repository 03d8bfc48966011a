"""The config's schema: defaults.yaml (every key, with a comment), the groups and folders recipes come from, the
free-form sections, and ConfigError."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sslkit.errors import UserError

__all__ = ["CONFIG_DIRS", "FREE_FORM", "GROUPS", "MISSING", "PACKAGE_CONFIG_DIR", "ConfigError", "config_dirs",
           "defaults_file", "flat_keys", "group_options", "in_free_form", "schema"]

PACKAGE_CONFIG_DIR = Path(__file__).resolve().parent


#: Folders searched for the ``config`` and ``data`` groups, the repository's ``configs/`` first.
CONFIG_DIRS: list[Path] = [PACKAGE_CONFIG_DIR.parents[1] / "configs"]


def config_dirs() -> list[Path]:
    """:data:`CONFIG_DIRS` as it is when called (what every reader of the recipe folders goes through)."""
    return CONFIG_DIRS


#: Keys whose contents are builder arguments, checked against the builder's signature.
FREE_FORM = {
    "hooks", "method.hooks", "data.train.kwargs", "data.test.kwargs", "data.transform", "data.eval_transform",
    "model.trunk_kwargs", "model.head", "model.kwargs", "loss", "eval.data.train.kwargs", "eval.data.test.kwargs",
    "masking", "model.freeze", "slurm.additional", "log.mlflow.tags", "distill.teacher_trunk_kwargs",
    "distill.students", "eval.reference.sets", "data.storage_options",
}


GROUPS = ("config", "data")


class ConfigError(UserError, ValueError):
    """A config that cannot run: what is wrong, with the key, and what to do."""


_DEFAULTS_FILE: dict[tuple[int, int], bytes] = {}


def defaults_file() -> DictConfig:
    """sslkit/config/defaults.yaml as loaded (parsed once a process while the file is unchanged; a copy, kept
    pickled: unpickling is the quick way to copy a config)."""
    st = (PACKAGE_CONFIG_DIR / "defaults.yaml").stat()
    key = (st.st_mtime_ns, st.st_size)
    if key not in _DEFAULTS_FILE:
        _DEFAULTS_FILE.clear()
        _DEFAULTS_FILE[key] = pickle.dumps(OmegaConf.load(PACKAGE_CONFIG_DIR / "defaults.yaml"))
    return pickle.loads(_DEFAULTS_FILE[key])


def schema() -> DictConfig:
    """sslkit/config/defaults.yaml without its defaults list: every valid key and its type."""
    cfg = defaults_file()
    cfg.pop("defaults")
    return cfg  # type: ignore[return-value]


def group_options(group: str) -> list[str]:
    return sorted({p.stem for d in CONFIG_DIRS for p in (d / group).glob("*.yaml")})


def flat_keys(cfg: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(cfg, DictConfig):
        for k in cfg.keys():
            path = f"{prefix}{k}"
            yield path
            if path not in FREE_FORM:
                yield from flat_keys(cfg._get_node(k), path + ".")


def in_free_form(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") or key.startswith(f + "[") for f in FREE_FORM)


MISSING = object()
