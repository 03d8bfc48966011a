"""A pretrained model out of a checkpoint file or a run folder: its config, its weights, its input normalisation."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from sslkit.checkpoint import CheckpointError, checkpoint_dir, latest_checkpoint, read_checkpoint
from sslkit.checkpointing.sharded import METADATA
from sslkit.config.compose import apply_overrides, import_modules
from sslkit.config.schema import ConfigError, schema
from sslkit.config.validate import validate
from sslkit.data.transforms import eval_resize
from sslkit.errors import UserError

__all__ = ["Pretrained", "eval_config", "load_pretrained", "normalisation", "pretrained_config", "resolve_checkpoint"]


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

    def encoder(self, part: str = "trunk") -> nn.Module:
        """``trunk``: the trunk's features; ``projector``: the head applied to them (the embedding the loss saw)."""
        if part == "trunk":
            return self.trunk
        if part == "projector":
            return nn.Sequential(self.trunk, self.model.head)  # type: ignore[arg-type]
        raise ConfigError(f"features={part!r}: use features=trunk (the encoder's output, what evaluation uses) or "
                          "features=projector (the head's output, the embedding the loss saw)")


def resolve_checkpoint(spec: str) -> tuple[str, str]:
    """``checkpoint=`` as given: a checkpoint file, a sharded checkpoint folder, or a run folder (its latest
    checkpoint, ``latest.txt``).

    Returns ``(checkpoint, run folder)``; the run folder of a checkpoint is the folder above its ``checkpoints/``
    (or the checkpoint's own folder). Raises :class:`CheckpointError` saying what was found instead.
    """
    if not spec:
        raise CheckpointError("no checkpoint given: add checkpoint=RUN_DIR (a run's output_dir: its latest "
                              "checkpoint is used) or checkpoint=FILE.pt")
    path = os.path.expanduser(spec)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, METADATA)):
        pass  # a sharded checkpoint folder itself: as a file
    elif os.path.isdir(path) and os.path.basename(os.path.normpath(path)).startswith("checkpoint_"):
        raise CheckpointError(f"checkpoint={spec}: this sharded checkpoint folder has no {METADATA}: its save never "
                              "finished, so it is not loaded. Give the run folder (its newest complete checkpoint "
                              "is used) or an older checkpoint.")
    elif os.path.isdir(path):
        found = latest_checkpoint(checkpoint_dir(path))
        if found is None:
            found = latest_checkpoint(path)  # the checkpoints/ folder itself
            run_dir = os.path.dirname(os.path.abspath(path)) if found else path
        else:
            run_dir = path
        if found is None:
            raise CheckpointError(f"checkpoint={spec}: the folder holds no checkpoint (no {checkpoint_dir(path)}/"
                                  "checkpoint_*.pt). Give a run's output_dir after at least one checkpoint was "
                                  "written, or a checkpoint file.")
        return found, run_dir
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint={spec}: no such file or folder. Give a run's output_dir (e.g. "
                              "runs/simclr-fashion_mnist) or a checkpoint file inside its checkpoints/ folder.")
    parent = os.path.dirname(os.path.abspath(path))
    run_dir = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent
    return path, run_dir


def _saved_config(state: dict[str, Any], path: str, run_dir: str) -> DictConfig:
    """The config the checkpoint was trained with: stored in it, else the run folder's config.yaml."""
    text = state.get("config")
    if isinstance(text, str) and text:
        return OmegaConf.create(text)
    candidate = os.path.join(run_dir, "config.yaml")
    if os.path.exists(candidate):
        return OmegaConf.load(candidate)  # type: ignore[return-value]
    raise CheckpointError(f"checkpoint {path} holds no config (written before sslkit stored it) and {candidate} does "
                          "not exist: put the run's config.yaml next to its checkpoints/ folder.")


def eval_config(saved: DictConfig, overrides: list[str]) -> DictConfig:
    """The run's config, completed with today's defaults for keys it predates, with ``overrides`` applied
    (``eval.knn.k=20``, ``machine.device=cpu``, ...) and validated like a training config: an unknown key is an
    error naming the closest one. ``distributed.*`` starts from the defaults (one process), not the run's."""
    cfg = OmegaConf.merge(schema(), saved)
    assert isinstance(cfg, DictConfig)
    OmegaConf.set_struct(cfg, False)
    # How the training run spread over processes says nothing of this evaluation's: one process unless an override
    # says otherwise. (Kept, a run from 4 GPUs or 2 nodes would fail the device check on a 1-GPU machine.)
    cfg.distributed = schema().distributed
    cfg.launcher = "local"  # an evaluation runs here (a SLURM-trained run's config says slurm)
    apply_overrides(cfg, overrides)
    import_modules(cfg)
    validate(cfg)
    OmegaConf.set_struct(cfg, True)
    return cfg


def _in_channels(model_state: dict[str, torch.Tensor]) -> int:
    """The trunk's input channels: the second dimension of its first convolution's weight."""
    for key, value in model_state.items():
        if key.startswith("trunk.") and value.ndim == 4:
            return int(value.shape[1])
    return 3


def build_model(cfg: DictConfig, in_channels: int) -> nn.Module:
    """The SSL model the config describes (trunk, head, the method's wiring), with fresh weights on the CPU:
    :func:`sslkit.builder.build_model`, as training builds it."""
    from sslkit.builder import build_model as build

    return build(cfg, in_channels)


def _read(spec: str, overrides: list[str] | None) -> tuple[str, str, dict[str, Any], DictConfig]:
    """The checkpoint ``spec`` names: its file, run folder, contents and validated evaluation config."""
    path, run_dir = resolve_checkpoint(spec)
    try:
        state = read_checkpoint(path, map_location="cpu")
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc}). If the run was "
                              "killed while writing it, its folder's latest.txt still names the last complete "
                              "one: give the run folder instead.") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not an sslkit checkpoint (no 'model' entry)")
    return path, run_dir, state, eval_config(_saved_config(state, path, run_dir), list(overrides or []))


def pretrained_config(spec: str, overrides: list[str] | None = None) -> DictConfig:
    """The validated evaluation config of the checkpoint ``spec`` names, without building its model: what a
    tool checks before it spawns processes (a bad checkpoint, key or device is then said once, up front)."""
    return _read(spec, overrides)[3]


def load_pretrained(spec: str, overrides: list[str] | None = None) -> Pretrained:
    """Read ``spec`` (a checkpoint file or a run folder) without running code (``weights_only``), rebuild its
    model from the config stored with it, load the weights (strictly: every key must match) onto
    ``machine.device`` and put it in eval mode."""
    from sslkit.builder import resolve_device

    path, run_dir, state, cfg = _read(spec, overrides)
    try:
        device = resolve_device(cfg.machine.device)
    except RuntimeError as exc:
        raise ConfigError(str(exc)) from None
    model = build_model(cfg, _in_channels(state["model"]))
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not fit the model its config describes: missing "
                              f"{list(missing)[:5]}, unexpected {list(unexpected)[:5]}. Was model.* overridden?")
    model.to(device).eval()
    step = int(state.get("position", {}).get("update", -1))
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


class ToolError(UserError):
    """A tool argument that cannot be used; the message names it and what to give."""
