"""A run's checkpoint read back with the config it was trained with: the run folder or file resolved, the config made
an evaluation config (what the tools after training and a distillation teacher read)."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from sslkit.checkpoint import CheckpointError, checkpoint_dir, latest_checkpoint, read_checkpoint
from sslkit.checkpointing.sharded import METADATA
from sslkit.config.compose import apply_overrides, import_modules
from sslkit.config.schema import schema
from sslkit.config.validate import validate

__all__ = ["eval_config", "in_channels", "read_run_checkpoint", "resolve_checkpoint", "saved_config"]


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


def saved_config(state: dict[str, Any], path: str, run_dir: str) -> DictConfig:
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
    saved = copy.deepcopy(saved)
    if "bench" in saved.get("eval", {}):  # the run's own bench settings say nothing of this evaluation (and a key
        with open_dict(saved):            # the bench has since renamed would stop it)
            del saved.eval["bench"]
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


def in_channels(model_state: dict[str, torch.Tensor]) -> int:
    """The trunk's input channels: the second dimension of its first convolution's weight."""
    for key, value in model_state.items():
        if (key.startswith("trunk.") or ".trunk." in key) and value.ndim == 4:  # (a distillation: its students)
            return int(value.shape[1])
    return 3


def read_run_checkpoint(spec: str, overrides: list[str] | None) -> tuple[str, str, dict[str, Any], DictConfig]:
    """The checkpoint ``spec`` names (:func:`resolve_checkpoint`): its file, run folder, contents (read without
    running code) and the run's config made an evaluation config (:func:`eval_config`, ``overrides`` applied)."""
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
    return path, run_dir, state, eval_config(saved_config(state, path, run_dir), list(overrides or []))
