"""Build an SSLTask from a validated config: the one place that reads the config and passes plain arguments on.

:func:`build_task` composes the builders, in the order the random numbers they draw keep: the process's runtime
(``runtime.py``), the training data and the run's length (``data.py``), the model pipeline (``model.py``, its
order in :func:`~sslkit.builder.model.build_training_model`'s docstring), the hooks (``hooks.py``).
"""

from __future__ import annotations

from omegaconf import DictConfig

from sslkit.builder.data import build_train_data, eval_sources, eval_specs, knn_subsample, limited, loader_for
from sslkit.builder.hooks import build_hooks
from sslkit.builder.model import (
    build_model,
    build_model_as_trained,
    build_training_model,
    freeze_parameters,
    mask_plan,
    trunk_arguments,
)
from sslkit.builder.runtime import resolve_device, resolve_num_workers, seed_everything, set_determinism, setup_runtime
from sslkit.config.text import config_yaml
from sslkit.guard import UpdateGuard
from sslkit.task import DataPlan, Phase, RunInfo, SSLTask, Training

__all__ = ["build_model", "build_model_as_trained", "build_task", "eval_sources", "eval_specs", "freeze_parameters",
           "knn_subsample", "limited", "loader_for", "mask_plan", "resolve_device", "resolve_num_workers",
           "seed_everything", "set_determinism", "trunk_arguments"]


def build_task(cfg: DictConfig) -> SSLTask:
    """Build data, model, loss, optimizer, schedules and hooks from ``cfg`` into an SSLTask."""
    device, rank, world = setup_runtime(cfg)
    data = build_train_data(cfg, device, world)
    parts = build_training_model(cfg, data, device, world)
    hooks, manual_reduction = build_hooks(cfg, data, parts, device, rank, world)
    o, rel = cfg.optim, cfg.reliability
    return SSLTask(
        Training(model=parts.model, loss=parts.loss, optimizer=parts.optimizer, lr_schedule=parts.lr_schedule,
                 wd_schedule=parts.wd_schedule, scaler=parts.scaler, amp_dtype=parts.amp_dtype,
                 micro_batches=o.micro_batches, global_batch_size=data.global_batch,
                 manual_gradient_reduction=manual_reduction, bucket_cap_mb=cfg.distributed.bucket_cap_mb,
                 channels_last=cfg.machine.channels_last, clip_grad=float(o.clip_grad),
                 clip_grad_mode=str(o.clip_grad_mode)),
        DataPlan(loaders={"train": data.loader}, phases=[Phase(train=True, epoch=e) for e in range(data.epochs)],
                 device_augment=data.device_augment, device_decoder=data.device_decoder,
                 masking=mask_plan(cfg, parts.trunk)),
        hooks,
        run=RunInfo(device=device, rank=rank, world_size=world, seed=cfg.seed, output_dir=cfg.output_dir, config=cfg,
                    config_text=config_yaml(cfg)),
        max_steps=data.max_steps,
        guard=UpdateGuard(rel.oom, rel.nonfinite_loss, rel.max_consecutive_skips, check_every=cfg.log.every_n_steps),
    )
