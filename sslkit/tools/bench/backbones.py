"""The backbones ``sslkit bench`` compares: sslkit runs and checkpoints, released weights files, timm architectures,
the raw pixels and random init, each read once, up front, with what identifies its weights."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from sslkit.errors import UserError
from sslkit.models.hf_weights import hf_config
from sslkit.models.tokens import TokenTrunk
from sslkit.models.weights import weights_digest

__all__ = ["Backbone", "BenchError", "load_backbones", "parse_list", "random_twins"]

logger = logging.getLogger("sslkit")

#: ImageNet's statistics: what released DINOv2 / DINOv3 and most timm weights expect.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
BASELINES = ("pixels", "random")
TIMM = "timm:"


class BenchError(UserError):
    """A backbone, dataset or protocol ``sslkit bench`` cannot use; the message names it and what to give."""


@dataclass
class Backbone:
    """One backbone of a bench: its name in the table, how to read its features, and what identifies them."""

    #: the name in the table (the spec as given, or ``random (ARCH)``)
    name: str
    #: run | weights | timm | pixels | random
    kind: str
    #: the architecture (sslkit trunk name, ``timm:NAME``, or ``pixels``)
    arch: str
    #: the network (None for pixels)
    module: nn.Module | None
    #: what the weights are: the SHA-256 of the network's state as read or drawn (:func:`weights_digest`); ``pixels``
    weights_id: str
    #: the evaluation transform: image_size, mean, std, resize, crop_pct, channels
    transform: dict[str, Any]
    #: extra identity (the part of a run, the student)
    details: dict[str, Any] = field(default_factory=dict)
    #: builds the architecture with fresh weights (what ``random`` draws); None for pixels and random
    fresh: Callable[[], nn.Module] | None = None


def parse_list(value: str) -> list[str]:
    """``[a, b:c, d@e]`` (or ``a,b``) as a list of strings; quotes around an item are dropped."""
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    return [item.strip().strip("'\"") for item in text.split(",") if item.strip()]


def _run_backbone(spec: str, cfg: DictConfig, device: str) -> Backbone:
    """An sslkit run folder, checkpoint file or sharded folder; ``:teacher``, ``:trunk`` or ``:STUDENT`` after it."""
    from sslkit.builder.model import trunk_arguments
    from sslkit.registry import TRUNKS, get
    from sslkit.tools.common import part_module
    from sslkit.tools.pretrained import load_pretrained, select_student

    path, part = spec, "trunk"
    if not os.path.exists(os.path.expanduser(spec)) and ":" in spec:
        path, part = spec.rsplit(":", 1)
    student = None if part in ("trunk", "teacher") else part
    pre = load_pretrained(path, [f"machine.device={device}"])
    select_student(pre, student)
    module = part_module(pre, "teacher" if part == "teacher" else "trunk")
    t = pre.config.data.eval_transform
    size = int(t.get("image_size", pre.config.data.image_size))
    channels = _channels(module)
    transform = {"image_size": size, "mean": _stats(t.get("mean"), channels, 0.5),
                 "std": _stats(t.get("std"), channels, 0.5), "resize": t.get("resize"), "crop_pct": t.get("crop_pct"),
                 "channels": channels}
    builder = get(TRUNKS, str(pre.config.model.trunk), "model.trunk")
    arguments = trunk_arguments(pre.config, builder, channels)
    return Backbone(spec, "run", str(pre.config.model.trunk), module.cpu().eval(), weights_digest(module), transform,
                    {"checkpoint": pre.path, "step": pre.step, "part": "teacher" if part == "teacher" else "trunk",
                     "student": student, "method": str(pre.config.method.name), "arch_kwargs": arguments},
                    fresh=lambda: builder(**arguments))


def _stats(values: Any, channels: int, default: float) -> list[float]:
    v = list(values) if values is not None else [default] * channels
    return [float(x) for x in (v * channels if len(v) == 1 and channels > 1 else v)]


def _channels(module: nn.Module) -> int:
    if isinstance(module, TokenTrunk):
        return int(module.in_channels)
    convs = [m for m in module.modules() if isinstance(m, nn.Conv2d)]
    return int(convs[0].in_channels) if convs else 3


def _weights_backbone(spec: str, cfg: DictConfig) -> Backbone:
    """``ARCH@FILE``: an sslkit ViT trunk (Meta's, timm's and transformers' layouts) or ``timm:NAME`` (timm's own
    layout, strict); or a transformers checkpoint alone, ``DIR``, whose config.json gives the trunk."""
    from sslkit.builder.common import trunk_kwargs
    from sslkit.models.weights import WeightsError, load_trunk, read_weights
    from sslkit.registry import TRUNKS, get

    arch, path = spec.split("@", 1) if "@" in spec else ("", spec)
    given: dict[str, Any] = {}
    if not arch:  # a transformers checkpoint: its config.json names the architecture
        arch, given = _hf_architecture(spec)
    elif not os.path.isfile(os.path.expanduser(path)) and hf_config(path) is None:
        raise BenchError(f"backbone {spec}: {path} is no file. ARCH@FILE names a weights file (.pth, .pt, "
                         ".safetensors) after the architecture, or a transformers folder")
    path = os.path.expanduser(path)
    size = int(cfg.eval.bench.image_size or cfg.data.image_size)
    if arch.startswith(TIMM):
        import timm

        name = arch[len(TIMM):]
        try:
            module = timm.create_model(name, pretrained=False, num_classes=0)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise BenchError(f"backbone {spec}: timm cannot build {name} ({exc}); give a timm model name "
                             "(timm.list_models())") from None
        try:
            module.load_state_dict(read_weights(path, f"backbone {spec}"), strict=True)
        except WeightsError as exc:
            raise BenchError(str(exc)) from None
        except RuntimeError as exc:
            raise BenchError(f"backbone {spec}: the file does not fit timm's {name}: "
                             f"{str(exc).splitlines()[-1].strip()[:300]}") from None
        pcfg = getattr(module, "pretrained_cfg", {}) or {}
        mean, std = pcfg.get("mean", IMAGENET_MEAN), pcfg.get("std", IMAGENET_STD)
        kind, arguments = "timm", {}

        def fresh() -> nn.Module:
            return timm.create_model(name, pretrained=False, num_classes=0)
    else:
        builder = get(TRUNKS, arch, f"backbone {spec}")
        arguments = trunk_kwargs(builder, {k: v for k, v in given.items() if k != "in_channels"},
                                 int(given.get("in_channels", 3)), size, int(cfg.data.patch_size))
        module = builder(**arguments)

        def fresh() -> nn.Module:
            return builder(**arguments)
        try:
            load_trunk(module, path, f"backbone {spec}", "its architecture")
        except WeightsError as exc:
            raise BenchError(str(exc)) from None
        mean, std, kind = IMAGENET_MEAN, IMAGENET_STD, "weights"
    transform = {"image_size": size, "mean": [float(m) for m in mean], "std": [float(s) for s in std],
                 "resize": None, "crop_pct": None, "channels": _channels(module)}
    return Backbone(spec, kind, arch, module.eval(), weights_digest(module), transform,
                    {"file": path, "arch_kwargs": arguments}, fresh=fresh)


def _hf_architecture(spec: str) -> tuple[str, dict[str, Any]]:
    """The sslkit trunk and arguments of the transformers checkpoint ``spec`` names (its ``config.json``)."""
    from sslkit.models.hf_weights import hf_trunk

    config = hf_config(spec)
    assert config is not None
    try:
        return hf_trunk(config)
    except ValueError as exc:
        raise BenchError(f"backbone {spec}: a transformers {config['model_type']} of {exc}") from None


def _pixels(cfg: DictConfig) -> Backbone:
    t = cfg.data.eval_transform
    transform = {"image_size": int(t.get("image_size", cfg.data.image_size)), "mean": None, "std": None,
                 "resize": t.get("resize"), "crop_pct": t.get("crop_pct"), "channels": None}
    return Backbone("pixels", "pixels", "pixels", None, "pixels", transform,
                    {"features": "the eval-transformed image, flattened (L2-normalised where a protocol compares)"})


def random_twins(backbones: list[Backbone], seed: int) -> list[Backbone]:
    """For each architecture among ``backbones`` (in order, once per architecture and arguments: a ViT-Tiny of 4 px
    patches and one of 7 px are two), the same network with fresh weights drawn from ``seed`` by its own
    constructor (a run's trunk as training builds it, a timm model by timm): the baseline a trained backbone must
    beat. Named ``random (ARCH)``, or ``random (ARCH, like NAME)`` when the architecture comes with other arguments
    too."""
    twins = []
    seen: set[str] = set()
    archs: set[str] = set()
    for b in backbones:
        shape = f"{b.arch}:{sorted(b.details.get('arch_kwargs', {}).items())}"
        if b.fresh is None or shape in seen:
            continue
        seen.add(shape)
        torch.manual_seed(int(seed))
        module = b.fresh()
        name = f"random ({b.arch})" if b.arch not in archs else f"random ({b.arch}, like {b.name})"
        archs.add(b.arch)
        twins.append(Backbone(name, "random", b.arch, module.eval(), weights_digest(module), dict(b.transform),
                              {"seed": int(seed), "like": b.name}))
    return twins


def load_backbones(specs: list[str], cfg: DictConfig, device: str) -> tuple[list[Backbone], dict[str, str]]:
    """Every backbone ``specs`` names, read (on the CPU) before anything is extracted: ``(backbones, failures)``,
    ``failures`` mapping a spec that cannot be read to why. ``random`` adds the random twin of each architecture
    read; ``pixels`` the raw pixels."""
    loaded: list[Backbone] = []
    failures: dict[str, str] = {}
    want_random = "random" in specs
    for spec in specs:
        if spec in BASELINES:
            if spec == "pixels":
                loaded.append(_pixels(cfg))
            continue
        try:
            weights = "@" in spec or hf_config(spec) is not None  # a transformers folder holds no sslkit run
            loaded.append(_weights_backbone(spec, cfg) if weights else _run_backbone(spec, cfg, device))
        except UserError as exc:
            failures[spec] = str(exc)
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            failures[spec] = f"{type(exc).__name__}: {exc}"
    if want_random:
        twins = random_twins(loaded, int(cfg.eval.bench.seed))
        if not twins and not failures:
            failures["random"] = ("random is the random init of the other backbones' architectures, and none is "
                                  "listed: add a run, ARCH@WEIGHTS or timm:NAME@WEIGHTS beside it")
        loaded.extend(twins)
    return loaded, failures
