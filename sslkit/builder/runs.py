"""A run's checkpoint read back with the config it was trained with: the run folder or file resolved, the config made
an evaluation config (what the tools after training and a distillation teacher read)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from sslkit.checkpoint import Checkpointer, CheckpointError
from sslkit.config.compose import apply_overrides, import_modules
from sslkit.config.schema import schema
from sslkit.config.upgrade import upgrade_saved
from sslkit.config.validate import validate
from sslkit.optim.param_groups import in_trunk

__all__ = ["eval_config", "in_channels", "read_run_checkpoint", "saved_config"]


def saved_config(state: dict[str, Any], path: str) -> DictConfig:
    """The config the checkpoint was trained with, which every checkpoint sslkit writes holds."""
    text = state.get("config")
    if not isinstance(text, str) or not text:
        raise CheckpointError(f"checkpoint {path} holds no config: every checkpoint sslkit writes stores the config "
                              "its run was trained with, so this file was not written by this version of sslkit (or "
                              "was edited). Retrain, or load its weights into a run of your own (model.pretrained).")
    return OmegaConf.create(text)


def eval_config(saved: DictConfig, overrides: list[str]) -> DictConfig:
    """The run's config, completed with today's defaults for keys it predates, with ``overrides`` applied
    (``eval.knn.k=20``, ``machine.device=cpu``, ...) and validated like a training config: an unknown key is an
    error naming the closest one. ``distributed.*`` starts from the defaults (one process), not the run's. Keys
    renamed since the run was trained are read under their new names (:func:`~sslkit.config.upgrade.upgrade_saved`)."""
    saved, _ = upgrade_saved(copy.deepcopy(saved))
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
        if in_trunk(key) and value.ndim == 4:  # (a distillation: its students' trunks too)
            return int(value.shape[1])
    return 3


def read_run_checkpoint(spec: str, overrides: list[str] | None) -> tuple[str, str, dict[str, Any], DictConfig]:
    """The checkpoint ``spec`` names (:meth:`~sslkit.checkpoint.Checkpointer.find`): its file, run folder, contents
    (read without running code) and the run's config made an evaluation config (:func:`eval_config`, ``overrides``
    applied)."""
    path, run_dir = Checkpointer.find(spec)
    try:
        state = Checkpointer.read(path)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc}). If the run was "
                              "killed while writing it, its folder's latest.txt still names the last complete "
                              "one: give the run folder instead.") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not an sslkit checkpoint (no 'model' entry)")
    return path, run_dir, state, eval_config(saved_config(state, path), list(overrides or []))
