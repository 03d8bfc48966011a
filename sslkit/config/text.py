"""The resolved config as YAML text, written by libyaml's emitter, its secrets left out (what a run folder and every
checkpoint hold)."""

from __future__ import annotations

from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from sslkit.config.secrets import redact_config

__all__ = ["config_yaml"]


def _c_dumper() -> type | None:
    """libyaml's emitter (C) with the string representer of OmegaConf's dumper (strings that would read back as
    numbers or booleans quoted): the text ``OmegaConf.to_yaml`` writes at a tenth of its Python emitter's time,
    which every checkpoint paid. None without libyaml or where OmegaConf's dumper is not where it was (not public
    API: tests/config/test_text.py compares the texts): ``OmegaConf.to_yaml`` itself then."""
    try:
        from omegaconf._utils import OmegaConfDumper
    except ImportError:
        return None
    if not getattr(yaml, "__with_libyaml__", False) or not hasattr(OmegaConfDumper, "str_representer"):
        return None

    class CDumper(yaml.CDumper):  # type: ignore[misc,name-defined]
        pass

    CDumper.add_representer(str, OmegaConfDumper.str_representer)
    return CDumper


_DUMPER = _c_dumper()


def config_yaml(cfg: DictConfig) -> str:
    """``cfg`` resolved, as YAML text that ``OmegaConf.create`` reads back to the same config, less its secrets
    (:func:`~sslkit.config.secrets.redact_config`: a remote filesystem's credentials are never written)."""
    container: Any = redact_config(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))  # type: ignore[arg-type]
    if _DUMPER is None:
        return OmegaConf.to_yaml(OmegaConf.create(container))
    return yaml.dump(container, Dumper=_DUMPER, default_flow_style=False, allow_unicode=True, sort_keys=False)
