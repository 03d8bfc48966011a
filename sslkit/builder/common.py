"""What the builders share: a config section as keyword arguments, and the pre-emption signals of a run."""

from __future__ import annotations

import inspect
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["preemption_signals", "section_kwargs", "trunk_kwargs"]


def section_kwargs(section: DictConfig, skip: tuple[str, ...] = ("name",)) -> dict[str, Any]:
    """A config section as plain keyword arguments (interpolations resolved), without the keys in ``skip``."""
    plain = OmegaConf.to_container(section, resolve=True)
    assert isinstance(plain, dict)
    return {k: v for k, v in plain.items() if k not in skip}


def trunk_kwargs(builder: Any, given: dict[str, Any], in_channels: int, image_size: int,
                 patch_size: int) -> dict[str, Any]:
    """A trunk builder's arguments: ``given``, the images' channels, and for a builder that takes them the data
    preset's image and patch size unless ``given`` has its own."""
    kwargs = {"in_channels": in_channels, **given}
    takes = inspect.signature(builder).parameters
    if "img_size" in takes:
        kwargs.setdefault("img_size", image_size)
    if "patch_size" in takes:
        kwargs.setdefault("patch_size", patch_size)
    return kwargs


def preemption_signals(cfg: DictConfig) -> list[str]:
    """``reliability.preemption_signals``, and SIGUSR2 in a SLURM job (its warning before pre-emption or the time
    limit: sslkit checkpoints, then the job requeues itself)."""
    names = list(cfg.reliability.preemption_signals)
    if cfg.get("launcher") == "slurm" and "SIGUSR2" not in names:
        names.append("SIGUSR2")
    return names

