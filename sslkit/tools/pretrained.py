"""A pretrained model out of a checkpoint file or a run folder: its config, its weights, its input normalisation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from sslkit.builder.runs import eval_config, in_channels, read_run_checkpoint
from sslkit.checkpoint import CheckpointError
from sslkit.config.schema import ConfigError
from sslkit.data.transforms import eval_resize
from sslkit.errors import UserError

__all__ = ["Pretrained", "eval_config", "load_pretrained", "normalisation", "pretrained_config", "select_student"]


@dataclass
class Pretrained:
    """A trained SSL model read back from a checkpoint, on ``device`` and in eval mode."""

    #: The run's config with the evaluation's overrides applied.
    config: DictConfig
    #: The checkpoint file read.
    path: str
    #: The run folder (where results go: ``<run_dir>/eval/``): the folder that holds ``checkpoints/``.
    run_dir: str
    #: The optimizer steps the checkpoint had trained.
    step: int
    #: The whole SSL model (trunk, projector, teachers, predictors).
    model: nn.Module
    device: torch.device

    @property
    def trunk(self) -> nn.Module:
        """The encoder: what kNN, the linear probe and the export use."""
        return self.model.trunk  # type: ignore[return-value]

    @property
    def channels(self) -> int:
        """The channels of the images the trunk takes (its first convolution's input)."""
        return in_channels(self.model.state_dict())

    def encoder(self, part: str = "trunk") -> nn.Module:
        """``trunk``: the trunk's features; ``projector``: the head applied to them (the embedding the loss saw)."""
        if part == "trunk":
            return self.trunk
        if part == "projector":
            return nn.Sequential(self.trunk, self.model.head)  # type: ignore[arg-type]
        raise ConfigError(f"features={part!r}: use features=trunk (the encoder's output, what evaluation uses) or "
                          "features=projector (the head's output, the embedding the loss saw)")


def build_model(cfg: DictConfig, in_channels: int) -> nn.Module:
    """The SSL model the config describes (trunk, head, the method's wiring), with fresh weights on the CPU:
    :func:`sslkit.builder.build_model`, as training builds it."""
    from sslkit.builder import build_model as build

    return build(cfg, in_channels)


def build_model_as_trained(cfg: DictConfig, in_channels: int) -> nn.Module:
    """:func:`build_model` with what training adds before the checkpoint's names exist (``model.lora``'s
    adapters): :func:`sslkit.builder.build_model_as_trained`."""
    from sslkit.builder import build_model_as_trained as build

    return build(cfg, in_channels)


def merge_lora(model: nn.Module) -> nn.Module:
    """The model with its LoRA adapters merged into the trunk's weights (:func:`sslkit.models.lora.merge_lora`)."""
    from sslkit.models.lora import merge_lora as merge

    return merge(model)


def pretrained_config(spec: str, overrides: list[str] | None = None) -> DictConfig:
    """The validated evaluation config of the checkpoint ``spec`` names, without building its model: what a
    tool checks before it spawns processes (a bad checkpoint, key or device is then said once, up front)."""
    return read_run_checkpoint(spec, overrides)[3]


def load_pretrained(spec: str, overrides: list[str] | None = None) -> Pretrained:
    """Read ``spec`` (a checkpoint file or a run folder) without running code (``weights_only``), rebuild its
    model from the config stored with it, load the weights (strictly: every key must match) onto
    ``machine.device`` and put it in eval mode."""
    from sslkit.builder import resolve_device

    path, run_dir, state, cfg = read_run_checkpoint(spec, overrides)
    try:
        device = resolve_device(cfg.machine.device)
    except RuntimeError as exc:
        raise ConfigError(str(exc)) from None
    model = build_model_as_trained(cfg, in_channels(state["model"]))
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not fit the model its config describes: missing "
                              f"{list(missing)[:5]}, unexpected {list(unexpected)[:5]}. Was model.* overridden?")
    merge_lora(model)  # LoRA adapters (model.lora) merged: the tools read and export the plain network
    model.to(device).eval()
    step = int(state["position"]["step"])
    return Pretrained(config=cfg, path=path, run_dir=run_dir, step=step, model=model, device=device)


def normalisation(cfg: DictConfig, channels: int) -> dict[str, Any]:
    """The input the encoder expects, from the evaluation transform: pixel values in [0, 1], then
    ``(x - mean) / std`` per channel (sslkit's default is 0.5 for both, not ImageNet's statistics)."""
    t = cfg.data.eval_transform
    mean = list(t.get("mean") or [0.5] * channels)
    std = list(t.get("std") or [0.5] * channels)
    size = int(t.get("image_size", cfg.data.image_size))
    return {"channels": channels, "image_size": size, "resize": eval_resize(size, t.get("resize"), t.get("crop_pct")),
            "pixel_range": [0.0, 1.0], "mean": [float(m) for m in mean], "std": [float(s) for s in std]}


def select_student(pre: Pretrained, name: str | None) -> None:
    """``student=NAME``: for a distillation run, make student ``name`` (default: the first) the trunk the tool reads
    (``pre.trunk``), and the config's ``model.trunk`` / ``model.trunk_kwargs`` that student's (what the export's twin
    and the tools' records read). Other runs have one trunk: ``student=`` is a :class:`ToolError` there."""
    from sslkit.methods.distill import DistillModel, student_specs

    if not isinstance(pre.model, DistillModel):
        if name:
            raise ToolError(f"student={name}: this {pre.config.method.name} run has one trunk; student= picks one of "
                            "a distillation run's students (method.name=distill)")
        return
    specs = {s["name"]: s for s in student_specs(OmegaConf.to_container(pre.config.distill.students, resolve=True))}
    chosen = name or next(iter(specs))
    if chosen not in specs:
        raise ToolError(f"student={chosen}: the run's students are {', '.join(specs)}")
    pre.model.select(chosen)
    with open_dict(pre.config):
        pre.config.model.trunk = specs[chosen]["trunk"]
        pre.config.model.trunk_kwargs = specs[chosen]["trunk_kwargs"]


class ToolError(UserError):
    """A tool argument that cannot be used; the message names it and what to give."""
