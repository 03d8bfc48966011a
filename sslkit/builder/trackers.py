"""The experiment trackers a run's config asks for (W&B, MLflow), started on rank 0 beside the log hook's sinks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sslkit.checkpoint import Checkpointer
from sslkit.config.diff import flatten_config
from sslkit.hooks.trackers import MlflowTracker, Tracker, WandbTracker, param_value

__all__ = ["build_trackers"]

logger = logging.getLogger("sslkit")


def _start(name: str, extra: str, make: Callable[[], Tracker]) -> list[Tracker]:
    """``[make()]``, or ``[]`` and a warning when the tracker's library is missing or its start fails."""
    try:
        return [make()]
    except ImportError as exc:
        logger.warning("log.%s.enabled: %s cannot be imported (%s); pip install 'sslkit[%s]'. The run goes on "
                       "without it", extra, name, exc, extra)
    except Exception as exc:  # a server, a store, a setting: the training run matters more
        logger.warning("%s could not start (%s: %s); the run goes on without it", name, type(exc).__name__, exc)
    return []


def build_trackers(cfg: DictConfig) -> list[Tracker]:
    """The trackers that ``log.wandb.enabled`` and ``log.mlflow.enabled`` ask for (rank 0 builds them). A run that
    resumes from a checkpoint in its folder continues the tracker runs named in trackers.json; a fresh start
    opens new ones."""
    log = cfg.log
    if not (log.wandb.enabled or log.mlflow.enabled):
        return []
    out = str(cfg.output_dir)
    resume = bool(cfg.checkpoint.auto_resume) and Checkpointer(out).latest() is not None
    config: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    trackers: list[Tracker] = []
    if log.wandb.enabled:
        w = log.wandb
        trackers += _start("W&B", "wandb", lambda: WandbTracker(
            out, project=w.project, entity=w.entity, name=w.name or cfg.name, tags=list(w.tags), mode=w.mode,
            config=config, resume=resume))
    if log.mlflow.enabled:
        m = log.mlflow
        params = {k: param_value(v) for k, v in flatten_config(config).items()}
        trackers += _start("MLflow", "mlflow", lambda: MlflowTracker(
            out, tracking_uri=m.tracking_uri, experiment=m.experiment, run_name=m.run_name or cfg.name,
            tags=dict(m.tags), params=params, resume=resume))
    return trackers
