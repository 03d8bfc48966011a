"""The resolved config as YAML text, written by libyaml's emitter (what a run folder and every checkpoint hold)."""

from __future__ import annotations

from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf._utils import OmegaConfDumper

__all__ = ["config_yaml"]

#: libyaml's emitter (C) with OmegaConf's representers: the text ``OmegaConf.to_yaml`` writes (strings that would
#: read back as numbers or booleans quoted, as OmegaConf's dumper does), at a tenth of its Python emitter's time,
#: which every checkpoint pays. PyYAML without libyaml falls back to OmegaConf's own dumper.
_Dumper: type = OmegaConfDumper
if getattr(yaml, "__with_libyaml__", False):
    class _CDumper(yaml.CDumper):  # type: ignore[misc,name-defined]
        pass

    _CDumper.add_representer(str, OmegaConfDumper.str_representer)
    _Dumper = _CDumper


def config_yaml(cfg: DictConfig) -> str:
    """``cfg`` resolved, as YAML text that ``OmegaConf.create`` reads back to the same config."""
    container: Any = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    return yaml.dump(container, Dumper=_Dumper, default_flow_style=False, allow_unicode=True, sort_keys=False)
