"""The hooks of a run: the method's and the added ones, then sslkit's own (freezing, logging, checkpoints,
pre-emption, the consistency check, the monitors, kNN), and the trackers among the log's sinks."""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset

from sslkit import registry as R
from sslkit.builder.common import preemption_signals, section_kwargs
from sslkit.builder.data import TrainData, eval_sources, fixed_subset, knn_subsample, loader_for, reference_sets
from sslkit.builder.model import ModelParts
from sslkit.config.schema import ConfigError
from sslkit.data.sources import DataSourceError
from sslkit.hooks import (
    CheckpointHook,
    ConsistencyCheckHook,
    FreezeParametersHook,
    JsonlSink,
    KNNHook,
    LogHook,
    SSLHook,
    TensorboardSink,
)
from sslkit.hooks.preemption import PreemptionHook
from sslkit.hooks.reference import ReferenceSet, ReferenceSetsHook
from sslkit.hooks.resolution import HighResolutionHook

__all__ = ["build_hooks"]

logger = logging.getLogger("sslkit")


def build_hooks(cfg: DictConfig, data: TrainData, parts: ModelParts, device: torch.device, rank: int,
                world: int) -> tuple[list[SSLHook], bool]:
    """The run's hooks (their slots order them): the method's (a null entry was dropped on purpose; compose checked
    none of them is required), the added ones, then freezing, logging, checkpoints, pre-emption, the consistency
    check, the monitors and kNN; on rank 0 the trackers join the log's sinks last, so that a failure before opens
    no tracker run that nothing ends. Returns the hooks and whether gradients are reduced after backward by hand."""
    out = cfg.output_dir
    sinks: list[Any] = []
    if rank == 0:
        sinks.append(JsonlSink(out))
        if cfg.log.tensorboard:
            sinks.append(TensorboardSink(f"{out}/tensorboard"))
    progress = cfg.log.progress_bar
    if progress == "auto":
        progress = sys.stderr.isatty() and rank == 0
    hooks: list[SSLHook] = [
        R.get(R.HOOKS, name, f"method.hooks.{name}")(**section_kwargs(kwargs, ()))
        for name, kwargs in cfg.method.hooks.items() if kwargs is not None
    ]
    hooks += [R.get(R.HOOKS, spec.name, f"hooks[{i}].name")(**section_kwargs(spec)) for i, spec in enumerate(cfg.hooks)]
    if data.phase is not None:
        hooks.append(HighResolutionHook(data.phase))
    if parts.frozen_later:
        hooks.append(FreezeParametersHook(parts.frozen_later))
    if parts.frozen_now:
        logger.info("model.freeze: %d parameter tensor(s) frozen for the whole run (%s)", len(parts.frozen_now),
                    ", ".join(parts.frozen_now[:4]) + (", ..." if len(parts.frozen_now) > 4 else ""))
    hooks.append(LogHook(cfg.log.every_n_steps, progress_bar=bool(progress), sinks=sinks))
    sharded = parts.fsdp if cfg.checkpoint.sharded == "auto" else bool(cfg.checkpoint.sharded)
    hooks.append(CheckpointHook(out, cfg.checkpoint.every_n_epochs, cfg.checkpoint.every_n_steps,
                                cfg.checkpoint.keep_last, sharded=sharded, async_save=cfg.checkpoint.async_save))
    signals = preemption_signals(cfg)
    if signals:
        hooks.append(PreemptionHook(signals, cfg.reliability.preemption_check_every_n_steps))
    manual_reduction = _manual_reduction(cfg, world)
    every = cfg.distributed.consistency_check_every_n_steps
    if every > 0 and parts.fsdp:
        logger.info("distributed.consistency_check_every_n_steps: off under fsdp, where each rank holds different "
                    "shards (there are no replicas to compare)")
    elif every > 0:
        hooks.append(ConsistencyCheckHook(every))
    hooks += _monitor_hooks(cfg, device, parts.trunk, data.source, sinks, data.workers, data.pin, parts.amp_dtype)
    if cfg.eval.knn.enabled:
        knn = _knn_hook(cfg, data.source, sinks, data.workers, data.pin, device)
        if knn is not None:
            hooks.append(knn)
    if cfg.eval.reference.sets:
        hooks.append(_reference_hook(cfg, sinks, data.workers, data.pin))
    if rank == 0:  # log.wandb, log.mlflow
        from sslkit.builder.trackers import build_trackers

        sinks += build_trackers(cfg)  # the list the log and kNN hooks hold: they write to the trackers too
    return hooks, manual_reduction


def _manual_reduction(cfg: DictConfig, world: int) -> bool:
    """``distributed.manual_gradient_reduction``, turned on by ``reliability.oom=skip`` with several processes."""
    if cfg.reliability.oom == "skip" and world > 1 and not cfg.distributed.manual_gradient_reduction:
        # DDP reduces gradients during backward: a rank whose backward ran out of memory would leave
        # the others in that collective. Backward under no_sync, agree, then reduce.
        logger.info("reliability.oom=skip with %d processes: gradients are reduced after backward "
                    "(distributed.manual_gradient_reduction), so every rank can skip the same step", world)
        return True
    return bool(cfg.distributed.manual_gradient_reduction)


def _monitor_hooks(cfg: DictConfig, device: torch.device, trunk: torch.nn.Module, train_source: Dataset,
                   sinks: list[Any], workers: int, pin: bool, amp_dtype: torch.dtype | None) -> list[SSLHook]:
    """``eval.monitors``: RankMe and the online linear probe (:class:`~sslkit.hooks.online.OnlineMonitorHook`);
    ``auto`` turns them on with CUDA only, where they cost little next to the step."""
    m = cfg.eval.monitors
    on = device.type == "cuda" if m.enabled == "auto" else bool(m.enabled)
    if not on:
        return []
    from sslkit.hooks.online import OnlineMonitorHook

    num_classes = int(getattr(train_source, "num_classes", 0))
    test_loader = None
    if m.online_linear and m.online_linear_test and num_classes > 0:
        try:
            _, test_source, _ = eval_sources(cfg, train_source)
            test_loader = loader_for(cfg, test_source, cfg.data.eval_transform, train=False,
                                  batch_size=cfg.eval.knn.batch_size, workers=workers, pin=pin)
        except (DataSourceError, ConfigError) as exc:
            logger.warning("online linear probe: no test top-1 (%s)", exc)
    logger.info("online monitors on (eval.monitors.enabled=%s): RankMe every %d steps%s", m.enabled,
                cfg.log.every_n_steps, ", an online linear probe" if m.online_linear and num_classes > 0 else "")
    return [OnlineMonitorHook(int(getattr(trunk, "out_dim", 0)), num_classes, device, cfg.log.every_n_steps,
                              m.rankme_samples, bool(m.online_linear), float(m.online_linear_lr), test_loader, sinks,
                              amp_dtype)]


def _knn_hook(cfg: DictConfig, train_source: Dataset, sinks: list[Any], workers: int, pin: bool,
              device: torch.device) -> KNNHook | None:
    try:
        train_source, test_source, num_classes = eval_sources(cfg, train_source)
    except (DataSourceError, ConfigError) as exc:
        logger.warning("kNN evaluation skipped: %s", exc)
        return None
    k = cfg.eval.knn
    channels = getattr(train_source, "channels", 3)
    loading = {"batch_size": k.batch_size, "workers": workers, "pin": pin}
    memory = loader_for(cfg, train_source, cfg.data.eval_transform, train=False, **loading)
    queries = loader_for(cfg, test_source, cfg.data.eval_transform, train=False, **loading)
    raw = None
    if k.baselines:  # the same eval crop without normalisation: pixels in [0, 1]
        identity = OmegaConf.create({**section_kwargs(cfg.data.eval_transform, ()), "mean": [0.0] * channels,
                                     "std": [1.0] * channels})
        raw = (loader_for(cfg, train_source, identity, train=False, **loading),
               loader_for(cfg, test_source, identity, train=False, **loading))
    curve, curve_k = None, None
    if k.every_n_epochs > 0:  # the curve: a fixed subsample on the CPU (eval.knn.subsample), apart from the final kNN
        n = knn_subsample(k.subsample, device)
        subsets = [fixed_subset(s, n, cfg.seed + i) for i, s in enumerate((train_source, test_source))]
        curve = tuple(loader_for(cfg, s, cfg.data.eval_transform, train=False, **loading) for s in subsets)
        # k scaled with the memory: 200 neighbours of 2000 reach far further than 200 of 60000 (on Fashion-MNIST
        # SimCLR features, 0.776 against the whole kNN's 0.853; 7 of them give 0.825, 17 of 5000 give 0.849)
        curve_k = max(1, round(k.k * len(subsets[0]) / len(train_source)))  # type: ignore[arg-type]
        logger.info("kNN curve every %d epoch(s) on %s train and %s test samples (eval.knn.subsample=%s) with k=%d "
                    "(eval.knn.k scaled to the memory), logged as knn_curve_top1; the final kNN uses every sample",
                    k.every_n_epochs, *(len(s) for s in subsets), k.subsample, curve_k)  # type: ignore[arg-type]
    kind, last_n = str(cfg.eval.vit_features), int(cfg.eval.vit_last_n)
    if kind != "pool":
        logger.info("kNN reads the ViT's %s features (eval.vit_features)%s", kind,
                    f", the last {last_n} blocks" if kind == "cls_last_n" else "")
    return KNNHook(memory, queries, num_classes, k=k.k, temperature=k.temperature,
                   every_n_epochs=k.every_n_epochs, baselines=k.baselines, sinks=sinks, raw_pixel_loaders=raw,
                   features=kind, last_n=last_n, curve_loaders=curve, curve_k=curve_k)


def _reference_hook(cfg: DictConfig, sinks: list[Any], workers: int, pin: bool) -> SSLHook:
    """``eval.reference``: the reference sets' loaders (the eval transform) and the hook that watches them."""
    r = cfg.eval.reference
    loading = {"batch_size": cfg.eval.knn.batch_size, "workers": workers, "pin": pin}
    sets = [ReferenceSet(name, loader_for(cfg, memory, cfg.data.eval_transform, train=False, **loading),
                         loader_for(cfg, queries, cfg.data.eval_transform, train=False, **loading), classes)
            for name, memory, queries, classes in reference_sets(cfg)]
    logger.info("reference sets (eval.reference): %s, kNN top-1 (k=%d) at the start, every %s update(s) and at the "
                "end; %s", ", ".join(s.name for s in sets), r.k, r.every_n_steps or "no",
                f"a warning below {1.0 - float(r.warn_drop):g} of the start" if cfg.model.pretrained else
                "no warning of a fall (the run starts from a random init, model.pretrained unset)")
    return ReferenceSetsHook(sets, every_n_steps=r.every_n_steps, k=r.k, temperature=r.temperature,
                             warn_drop=r.warn_drop, sinks=sinks, features=str(cfg.eval.vit_features),
                             last_n=int(cfg.eval.vit_last_n), warn=bool(cfg.model.pretrained))
