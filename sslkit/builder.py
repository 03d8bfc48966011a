"""Build an SSLTask from a validated config: the one place that reads the config and passes plain arguments on."""

from __future__ import annotations

import fnmatch
import functools
import inspect
import logging
import math
import os
import random
import signal
import sys
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset, Subset

import sslkit.models  # noqa: F401  (registrations)
from sslkit import registry as R
from sslkit.config.compose import ConfigError, freeze_entries, per_process_batch
from sslkit.data import SSLDataset, StatefulDistributedSampler, build_loader, build_source, build_transform
from sslkit.data.device_augment import DeviceAugment, ReadForDevice, device_augment_for
from sslkit.data.device_decode import DeviceDecoder, collate_raw
from sslkit.data.loader import collate_views
from sslkit.data.sources import DataSourceError
from sslkit.distributed import get_rank, get_world_size, setup_control_group
from sslkit.errors import did_you_mean
from sslkit.guard import UpdateGuard
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
from sslkit.models.masking import MaskPlan
from sslkit.optim import build_optimizer, build_schedule, scaled_lr
from sslkit.parallel import parallelize
from sslkit.reliability import PreemptionHook
from sslkit.task import DataPlan, Phase, RunInfo, SSLTask, Training

__all__ = ["build_model", "build_task", "eval_sources", "eval_specs", "freeze_parameters", "mask_plan",
           "resolve_device", "resolve_num_workers", "seed_everything", "set_determinism", "trunk_arguments"]

logger = logging.getLogger("sslkit")


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cuda`` on a machine without one is an error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("machine.device=cuda but no CUDA device is visible; use machine.device=cpu or auto")
        if name == "cuda":
            name = f"cuda:{torch.cuda.current_device()}"
        torch.cuda.set_device(name)  # so that events, streams and caches default to this GPU too
    return torch.device(name)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_determinism(deterministic: bool, device: torch.device) -> None:
    """``machine.deterministic``: everything PyTorch needs for run-to-run identical results on CUDA.

    On: ``torch.use_deterministic_algorithms(True)`` (deterministic kernels, and an error naming
    any operation that has none), cuDNN in deterministic mode without autotuning, and
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which cuBLAS reads when its first handle is made (so
    :func:`build_task` calls this before anything computes on the device; a value the user
    exported is kept). Off: cuDNN autotunes its convolution
    algorithms on CUDA (``cudnn.benchmark``), the fastest choice for the fixed crop sizes of SSL.
    Data order and augmentations are deterministic either way (seeded by seed, epoch, index).
    """
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if deterministic or torch.are_deterministic_algorithms_enabled():  # (off by default: the call imports inductor)
        torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = device.type == "cuda" and not deterministic


def _cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a SLURM allocation), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_num_workers(setting: int | str, device: torch.device) -> tuple[int, str]:
    """``data.num_workers``: the number itself, or for ``auto`` one derived from the cores per process.

    The cores (affinity mask) are shared by the processes of this machine (``LOCAL_WORLD_SIZE``).
    On CUDA the model runs on the GPU and the training process needs one core to feed it, so the
    workers take the rest: ``cores - 1`` (15 on a 16-core, 1-GPU machine). On the CPU the model
    itself computes on those cores, so the workers take half. Returns the number and how it was
    chosen, for the log.
    """
    if setting != "auto":
        return int(setting), "data.num_workers"
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    cores = max(1, _cores() // local)
    share = f"{cores} core(s) per process ({_cores()} for {local} process(es))"
    if device.type == "cuda":
        return max(1, cores - 1), f"auto: {share}, one kept for the training process"
    return max(1, cores // 2), f"auto: {share}, half of them for the model on the CPU"


def _kwargs(section: DictConfig, skip: tuple[str, ...] = ("name",)) -> dict[str, Any]:
    plain = OmegaConf.to_container(section, resolve=True)
    assert isinstance(plain, dict)
    return {k: v for k, v in plain.items() if k not in skip}


def limited(ds: Dataset, limit: int) -> Dataset:
    """The first ``limit`` samples of ``ds`` (all if 0), keeping ``num_classes`` and ``channels``."""
    if limit <= 0 or limit >= len(ds):  # type: ignore[arg-type]
        return ds
    return _subset(ds, range(limit))


def _subset(ds: Dataset, indices: Any) -> Dataset:
    """``Subset(ds, indices)`` that keeps the dataset's ``num_classes`` and ``channels``."""
    sub = Subset(ds, indices)
    sub.num_classes = getattr(ds, "num_classes", 0)  # type: ignore[attr-defined]
    sub.channels = getattr(ds, "channels", 3)  # type: ignore[attr-defined]
    return sub


def _source(cfg: DictConfig, split: str) -> Dataset:
    spec = cfg.data[split]
    name = spec.source or cfg.data.train.source
    path = spec.path if spec.path is not None else cfg.data.train.path
    return limited(build_source(name, split, path, **_kwargs(spec.kwargs, ())), cfg.data.limit)


def loader_for(cfg: DictConfig, source: Dataset, transform: DictConfig, *, train: bool, batch_size: int,
            workers: int, pin: bool, device_augment: DeviceAugment | None = None) -> Any:
    """A loader of ``source``; the train loader keeps its workers from epoch to epoch (the eval loaders,
    used once at the end, do not hold processes all run long). With ``device_augment`` the workers only read
    and draw each sample's augmentation parameters (:class:`~sslkit.data.device_augment.ReadForDevice`); batches
    of images of many sizes come packed (:func:`~sslkit.data.device_decode.collate_raw`)."""
    made = ReadForDevice(device_augment.num_views) if device_augment is not None else \
        build_transform(transform.name, **_kwargs(transform))
    ds = SSLDataset(source, made, seed=cfg.seed)
    sampler = StatefulDistributedSampler(
        len(ds), num_replicas=get_world_size(), rank=get_rank(), shuffle=train, seed=cfg.seed,
        drop_last=train and cfg.data.drop_last,
    )
    ignores = tuple(int(getattr(signal, name)) for name in preemption_signals(cfg))
    collate = functools.partial(collate_views, stack=collate_raw) if device_augment is not None else collate_views
    return build_loader(ds, batch_size, sampler, num_workers=workers, pin_memory=pin,
                        drop_last=train and cfg.data.drop_last, persistent_workers=train, worker_ignores=ignores,
                        collate_fn=collate)


def _device_augment(cfg: DictConfig, device: torch.device) -> DeviceAugment | None:
    """``data.augment_on``: the batch augmentation, or None where the workers augment. ``auto`` is ``device``
    wherever the training transform has a device version (else workers, said in the log): on CUDA, where the
    worker pipeline starves the GPU, and on the CPU, where it measured faster too (docs/data.md)."""
    choice = cfg.data.augment_on
    if choice == "workers":
        return None
    try:
        augment = device_augment_for(build_transform(cfg.data.transform.name, **_kwargs(cfg.data.transform)))
    except ValueError as exc:  # augment_on=device was checked with the config; auto falls back
        logger.info("data: augmented in the loader workers (data.augment_on=auto): %s", exc)
        return None
    logger.info("data: augmented on the training device (data.augment_on=%s); the loader workers only read", choice)
    return augment


def _device_decoder(cfg: DictConfig, source: Dataset, device: torch.device, augment: DeviceAugment | None,
                    describe: Any) -> DeviceDecoder | None:
    """``data.decode_on``: a decoder of JPEG bytes on the training device, where the source has files and the
    batch is augmented there; ``auto`` decodes on CUDA, and in the workers on the CPU (which has the workers'
    cores for it). Tells the source to give its JPEGs as bytes."""
    choice = cfg.data.decode_on
    if augment is None:
        if choice == "device":  # augment_on=auto fell back to the workers (a transform without a device version)
            raise ConfigError("data.decode_on=device needs the augmentation on the device too, and data.augment_on="
                              f"{cfg.data.augment_on} augments in the loader workers here ({cfg.data.transform.name} "
                              "has no device version): use data.decode_on=auto")
        return None
    files = source.dataset if isinstance(source, Subset) else source
    if not hasattr(files, "jpeg_bytes"):
        return None  # tensors in memory, nothing to decode
    if choice == "workers" or (choice == "auto" and device.type != "cuda"):
        return None
    files.jpeg_bytes = True
    logger.info("data: JPEG files decoded on the training device in batches (data.decode_on=%s)", choice)
    return DeviceDecoder(getattr(files, "channels", 3), describe)


def compile_parts(model: torch.nn.Module, kinds: tuple[type, ...], backend: str, mode: str) -> list[str]:
    """``machine.compile``: ``torch.compile`` every submodule of ``model`` of a type in ``kinds`` (the trunks and
    heads: students, teachers, key encoders, predictors), in place (``Module.compile``), so parameter names,
    checkpoints, DDP and the hooks that update teachers see the same modules. The method's own wiring (queues,
    shuffles, momentum updates) stays eager: it is small, and Python state there would make dynamo recompile.
    Returns the compiled modules' names."""
    names = [name for name, m in model.named_modules() if isinstance(m, kinds)]
    for name in names:
        model.get_submodule(name).compile(backend=backend, mode=None if mode == "default" else mode)
    logger.info("machine.compile: %d module(s) compiled with torch.compile (backend %s, mode %s): %s; the first "
                "steps are slower while they compile", len(names), backend, mode, ", ".join(names))
    return names


def preemption_signals(cfg: DictConfig) -> list[str]:
    """``reliability.preemption_signals``, and SIGUSR2 in a SLURM job (its warning before pre-emption or the time
    limit: sslkit checkpoints, then the job requeues itself)."""
    names = list(cfg.reliability.preemption_signals)
    if cfg.get("launcher") == "slurm" and "SIGUSR2" not in names:
        names.append("SIGUSR2")
    return names


def build_task(cfg: DictConfig) -> SSLTask:
    """Build data, model, loss, optimizer, schedules and hooks from ``cfg`` into an SSLTask."""
    rank, world = get_rank(), get_world_size()
    device = resolve_device(cfg.machine.device)
    set_determinism(cfg.machine.deterministic, device)
    if cfg.machine.num_threads > 0:
        torch.set_num_threads(cfg.machine.num_threads)
    seed_everything(cfg.seed + rank)
    setup_control_group()  # every rank, before any other group is created

    train_source = _source(cfg, "train")
    workers, why = resolve_num_workers(cfg.data.num_workers, device)
    pin = device.type == "cuda" if cfg.data.pin_memory == "auto" else bool(cfg.data.pin_memory)
    logger.info("data: %d loader worker(s) per process (%s), pinned memory %s", workers, why, "on" if pin else "off")
    device_augment = _device_augment(cfg, device)
    if device_augment is not None and cfg.machine.compile:
        device_augment.compile(cfg.machine.compile_backend, None if cfg.machine.compile_mode == "default"
                               else cfg.machine.compile_mode)
    batch = per_process_batch(cfg, world)
    if cfg.data.global_batch_size > 0:
        logger.info("data.global_batch_size=%d: %d image(s) per process and micro-batch (%d process(es) x "
                    "optim.accumulate_steps=%d)", cfg.data.global_batch_size, batch, world, cfg.optim.accumulate_steps)
    train_loader = loader_for(cfg, train_source, cfg.data.transform, train=True, batch_size=batch,
                           workers=workers, pin=pin, device_augment=device_augment)
    device_decoder = _device_decoder(cfg, train_source, device, device_augment, train_loader.dataset.describe)
    accumulate = cfg.optim.accumulate_steps
    steps_per_epoch = len(train_loader) // accumulate
    if steps_per_epoch == 0:
        n = len(train_source)  # type: ignore[arg-type]
        per_step = batch * world * accumulate
        most = max(1, n // (world * accumulate))
        cut = " (data.limit keeps only those; raise it)" if 0 < cfg.data.limit <= n else ""
        fix = (f"Set data.global_batch_size={min(most, batch) * world * accumulate} or lower"
               if cfg.data.global_batch_size > 0 else f"Set data.batch_size={min(most, batch)} or lower")
        raise ConfigError(
            f"data.batch_size={batch}: one optimizer step takes {batch} x {world} "
            f"process(es) x optim.accumulate_steps={accumulate} = {per_step} images, and the training data has "
            f"{n}{cut}: no step would run. {fix}, or use more data."
        )
    global_batch = batch * world * accumulate
    if cfg.optim.max_steps > 0:
        max_iterations = cfg.optim.max_steps
        epochs = math.ceil(max_iterations / steps_per_epoch)
    else:
        epochs = cfg.optim.epochs
        max_iterations = epochs * steps_per_epoch

    model: torch.nn.Module = build_model(cfg, getattr(train_source, "channels", 3))
    trunk, head = model.trunk, getattr(model, "head", None)
    frozen_now, frozen_later = freeze_parameters(model, freeze_entries(cfg.model.freeze))
    model = model.to(device)
    fsdp = cfg.distributed.strategy == "fsdp" and world > 1
    if cfg.machine.channels_last and not fsdp:  # FSDP2 shards contiguous parameters only (a ViT's one conv)
        model = model.to(memory_format=torch.channels_last)
    if cfg.distributed.strategy == "fsdp" and world == 1:
        logger.info("distributed.strategy=fsdp with one process: nothing to shard, the model is trained whole "
                    "(its checkpoints load into fsdp runs of any size)")
    per_block_compile = cfg.machine.compile and fsdp  # FSDP units are blocks: compile those, inside them
    if cfg.machine.compile and not per_block_compile:
        kinds = tuple(t for t in (type(trunk), type(head)) if t not in (type(None), torch.nn.Identity))
        compile_parts(model, kinds, cfg.machine.compile_backend, cfg.machine.compile_mode)
    if cfg.distributed.sync_bn and world > 1:
        from sslkit.models.sync_batchnorm import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, device)
    if cfg.model.activation_checkpointing or fsdp:
        # activation checkpointing, per-block compile, FSDP2: in that order, before the optimizer sees the parameters
        compile_kwargs = ({"backend": cfg.machine.compile_backend,
                           "mode": None if cfg.machine.compile_mode == "default" else cfg.machine.compile_mode}
                          if per_block_compile else None)
        param_dtype = torch.bfloat16 if cfg.amp.enabled and cfg.amp.dtype == "bfloat16" else None
        model = parallelize(model, strategy=cfg.distributed.strategy, device=device, world_size=world,
                            activation_checkpointing=cfg.model.activation_checkpointing,
                            compile_kwargs=compile_kwargs, param_dtype=param_dtype)
    loss = R.get(R.LOSSES, cfg.loss.name, "loss.name")(**_kwargs(cfg.loss)).to(device)
    if hasattr(loss, "set_epoch_length"):  # schedules a loss takes in epochs (DINO's teacher temperature warm-up)
        loss.set_epoch_length(steps_per_epoch)

    o = cfg.optim
    lr = scaled_lr(o.lr, global_batch, o.lr_scaling)
    try:
        optimizer = build_optimizer(model, o.name, lr, weight_decay=o.weight_decay, momentum=o.momentum,
                                    nesterov=o.nesterov, betas=tuple(o.betas), eta=o.eta,
                                    exclude_bias_and_norm=o.exclude_bias_and_norm, layer_decay=o.layer_decay,
                                    patch_embed_lr_mult=o.patch_embed_lr_mult)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    warmup = min(o.warmup_epochs * steps_per_epoch / max_iterations, 0.999)
    lr_schedule = build_schedule(o.schedule, lr, o.final_lr, warmup_fraction=warmup)
    # a constant weight decay is a schedule too: it is set and logged at every update like the others
    wd_schedule = (build_schedule("cosine", o.weight_decay, o.final_weight_decay) if o.final_weight_decay is not None
                   else build_schedule("constant", o.weight_decay))

    if world > 1 and not fsdp:  # after the optimizer saw the plain parameters; teachers (no gradients) get no reduction
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None,
            bucket_cap_mb=cfg.distributed.bucket_cap_mb,
            find_unused_parameters=cfg.distributed.find_unused_parameters,
        )

    amp_dtype = None
    scaler = None
    if cfg.amp.enabled:
        amp_dtype = torch.bfloat16 if cfg.amp.dtype == "bfloat16" else torch.float16
        if amp_dtype == torch.float16:
            scaler = torch.amp.GradScaler(device.type)

    out = cfg.output_dir
    sinks: list[Any] = []
    if rank == 0:
        sinks.append(JsonlSink(out))
        if cfg.log.tensorboard:
            sinks.append(TensorboardSink(f"{out}/tensorboard"))
    progress = cfg.log.progress_bar
    if progress == "auto":
        progress = sys.stderr.isatty() and rank == 0
    # the method's hooks (a null entry was dropped on purpose; compose checked none of them is required), then the
    # added ones; their slots order them with the ones below
    hooks: list[SSLHook] = [
        R.get(R.HOOKS, name, f"method.hooks.{name}")(**_kwargs(kwargs, ()))
        for name, kwargs in cfg.method.hooks.items() if kwargs is not None
    ]
    hooks += [R.get(R.HOOKS, spec.name, f"hooks[{i}].name")(**_kwargs(spec)) for i, spec in enumerate(cfg.hooks)]
    if frozen_later:
        hooks.append(FreezeParametersHook(frozen_later))
    if frozen_now:
        logger.info("model.freeze: %d parameter tensor(s) frozen for the whole run (%s)", len(frozen_now),
                    ", ".join(frozen_now[:4]) + (", ..." if len(frozen_now) > 4 else ""))
    hooks.append(LogHook(cfg.log.every_n_steps, progress_bar=bool(progress), sinks=sinks))
    sharded = fsdp if cfg.checkpoint.sharded == "auto" else bool(cfg.checkpoint.sharded)
    hooks.append(CheckpointHook(out, cfg.checkpoint.every_n_epochs, cfg.checkpoint.every_n_steps,
                                cfg.checkpoint.keep_last, sharded=sharded, async_save=cfg.checkpoint.async_save))
    rel = cfg.reliability
    signals = preemption_signals(cfg)
    if signals:
        hooks.append(PreemptionHook(signals, rel.preemption_check_every_n_steps))
    manual_reduction = cfg.distributed.manual_gradient_reduction
    if rel.oom == "skip" and world > 1 and not manual_reduction:
        # DDP reduces gradients during backward: a rank whose backward ran out of memory would leave
        # the others in that collective. Backward under no_sync, agree, then reduce.
        logger.info("reliability.oom=skip with %d processes: gradients are reduced after backward "
                    "(distributed.manual_gradient_reduction), so every rank can skip the same step", world)
        manual_reduction = True
    if cfg.distributed.consistency_check_every_n_steps > 0 and fsdp:
        logger.info("distributed.consistency_check_every_n_steps: off under fsdp, where each rank holds different "
                    "shards (there are no replicas to compare)")
    elif cfg.distributed.consistency_check_every_n_steps > 0:
        hooks.append(ConsistencyCheckHook(cfg.distributed.consistency_check_every_n_steps))
    loaders = {"train": train_loader}
    hooks += _monitor_hooks(cfg, device, trunk, train_source, sinks, workers, pin, amp_dtype)
    if cfg.eval.knn.enabled:
        knn = _knn_hook(cfg, train_source, sinks, workers, pin, device)
        if knn is not None:
            hooks.append(knn)

    if rank == 0:  # log.wandb, log.mlflow: last, so that a failure above opens no tracker run that nothing ends
        from sslkit.hooks.trackers import build_trackers

        sinks += build_trackers(cfg)  # the list the log and kNN hooks hold: they write to the trackers too
    task = SSLTask(
        Training(model=model, loss=loss, optimizer=optimizer, lr_schedule=lr_schedule, wd_schedule=wd_schedule,
                 scaler=scaler, amp_dtype=amp_dtype, accumulate_steps=accumulate, global_batch_size=global_batch,
                 manual_gradient_reduction=manual_reduction, bucket_cap_mb=cfg.distributed.bucket_cap_mb,
                 channels_last=cfg.machine.channels_last, clip_grad=float(o.clip_grad),
                 clip_grad_mode=str(o.clip_grad_mode)),
        DataPlan(loaders=loaders, phases=[Phase(train=True, epoch=e) for e in range(epochs)],
                 device_augment=device_augment, device_decoder=device_decoder, masking=mask_plan(cfg, trunk)),
        hooks,
        run=RunInfo(device=device, rank=rank, world_size=world, seed=cfg.seed, output_dir=out, config=cfg),
        max_iterations=max_iterations,
        guard=UpdateGuard(rel.oom, rel.nonfinite_loss, rel.max_consecutive_skips, check_every=cfg.log.every_n_steps),
    )
    return task


def trunk_arguments(cfg: DictConfig, builder: Any, in_channels: int) -> dict[str, Any]:
    """The trunk builder's arguments: ``model.trunk_kwargs``, and for a builder that takes them the image and patch
    size of the data preset (``data.image_size``, ``data.patch_size``) unless the kwargs give their own."""
    kwargs = {"in_channels": in_channels, **_kwargs(cfg.model.trunk_kwargs, ())}
    takes = inspect.signature(builder).parameters
    if "img_size" in takes:
        kwargs.setdefault("img_size", int(cfg.data.image_size))
    if "patch_size" in takes:
        kwargs.setdefault("patch_size", int(cfg.data.patch_size))
    return kwargs


def build_model(cfg: DictConfig, in_channels: int) -> torch.nn.Module:
    """The SSL model the config describes: trunk (``model.trunk``), head (``model.head``) and the method's wiring
    (``model.name``), with fresh weights on the current default device (what training and the evaluation tools
    both build)."""
    import sslkit.methods  # noqa: F401  (registrations)

    builder = R.get(R.TRUNKS, cfg.model.trunk, "model.trunk")
    trunk = builder(**trunk_arguments(cfg, builder, in_channels))
    head = R.get(R.HEADS, cfg.model.head.name, "model.head.name")(in_dim=trunk.out_dim, **_kwargs(cfg.model.head))
    return R.get(R.MODELS, cfg.model.name, "model.name")(trunk=trunk, head=head, **_kwargs(cfg.model.kwargs, ()))


def freeze_parameters(model: torch.nn.Module, entries: list[tuple[str, str | None, int]]
                      ) -> tuple[list[str], list[tuple[list[str], str, int]]]:
    """``model.freeze``: the parameters an entry freezes for the whole run get ``requires_grad=False`` now (so no
    optimizer, weight decay or DDP reduction sees them); those frozen for the first N updates or epochs are
    returned for :class:`~sslkit.hooks.freeze.FreezeParametersHook`. Returns ``(frozen names, [(names, unit, n)])``."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    now: list[str] = []
    later: list[tuple[list[str], str, int]] = []
    params = dict(model.named_parameters())
    for i, (glob, unit, n) in enumerate(entries):
        matched = fnmatch.filter(names, glob)
        if not matched:
            prefix = glob.split("*")[0].rsplit(".", 1)[0]
            near = [n for n in names if n.startswith(prefix)][:6] or names[:6]
            raise ConfigError(f"'model.freeze[{i}]' = {glob} matches no parameter of the "
                              f"model.{did_you_mean(glob, names)} Parameters are named like {', '.join(near)} "
                              "(model.named_parameters())")
        if unit is None:
            for name in matched:
                params[name].requires_grad_(False)
            now += matched
        elif n > 0:
            later.append((matched, unit, n))
    return now, later


def mask_plan(cfg: DictConfig, trunk: torch.nn.Module) -> MaskPlan | None:
    """``masking``: the mask stage of the run (:class:`~sslkit.models.masking.MaskPlan`), or None without masks."""
    m = cfg.masking
    if m.name in (None, "none"):
        return None
    generator = R.get(R.MASKINGS, m.name, "masking.name")(**_kwargs(m, ("name", "views")))
    views = list(m.views) if m.views is not None else None
    plan = MaskPlan(generator, int(trunk.patch_size), int(cfg.seed), views)  # type: ignore[arg-type]
    logger.info("masking: %s (%s), drawn on the device per sample", m.name, plan)
    return plan


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


#: Sources whose test split is a path of its own (the others find their test files next to the train ones).
_OWN_TEST_PATH = ("folder", "filelist")


def eval_specs(cfg: DictConfig) -> dict[str, tuple[str, str | None, dict[str, Any], str]]:
    """Where the labelled evaluation sets come from, per split: ``(source, path, kwargs, where)``, ``where`` the
    config section that set it. ``eval.data.*`` when given (a run on unlabelled images is measured on those),
    else the training data's own splits (``data.train``, ``data.test``)."""
    e, d = cfg.eval.data, cfg.data
    if e.train.source is None and e.train.path is None:
        if e.test.source is not None or e.test.path is not None:
            raise ConfigError("eval.data.test is set but eval.data.train is not: kNN and the linear probe need both "
                              "a labelled training set (eval.data.train.path=...) and a test set")
        train_source = d.train.source
        test_source = d.test.source or train_source
        test_path = d.test.path if d.test.path is not None else (None if test_source in _OWN_TEST_PATH
                                                                   else d.train.path)
        return {"train": (train_source, d.train.path, _kwargs(d.train.kwargs, ()), "data.train"),
                "test": (test_source, test_path, _kwargs(d.test.kwargs, ()), "data.test")}
    train_source = e.train.source or d.train.source
    test_source = e.test.source or train_source
    test_path = e.test.path if e.test.path is not None else (None if test_source in _OWN_TEST_PATH else e.train.path)
    test_kwargs = _kwargs(e.test.kwargs, ()) or _kwargs(e.train.kwargs, ())
    return {"train": (train_source, e.train.path, _kwargs(e.train.kwargs, ()), "eval.data.train"),
            "test": (test_source, test_path, test_kwargs, "eval.data.test")}


def eval_sources(cfg: DictConfig, train_source: Dataset | None = None) -> tuple[Dataset, Dataset, int]:
    """The labelled train and test sets of kNN and the linear probe (:func:`eval_specs`), and their number of
    classes; ``train_source``, the training data already built, is used again when it is the train set. Raises
    :class:`DataSourceError` when they have no labels or no test split, saying what to set."""
    specs = eval_specs(cfg)
    sets: list[Dataset] = []
    for split in ("train", "test"):
        source, path, kwargs, where = specs[split]
        if split == "train" and where == "data.train" and train_source is not None:
            sets.append(train_source)
            continue
        if path is None and source in _OWN_TEST_PATH:
            raise DataSourceError(f"{where}.path is not set: a {source} source needs the path of its {split} set. "
                                  f"Set {where}.path (or eval.data.train.path and eval.data.test.path for labelled "
                                  "sets of their own)")
        sets.append(limited(build_source(source, split, path, **kwargs), cfg.data.limit))
    num_classes = int(getattr(sets[0], "num_classes", 0))
    if num_classes <= 0:
        source, path, _, where = specs["train"]
        raise DataSourceError(f"{where} ({source}{', ' + str(path) if path else ''}) has no labels, and kNN and the "
                              "linear probe need them: give labelled sets with eval.data.train.path=... and "
                              "eval.data.test.path=... (a folder of class folders, or a file list with labels)")
    return sets[0], sets[1], num_classes


def knn_subsample(setting: Any, device: torch.device) -> int:
    """Samples per split of the kNN curve (``eval.knn.subsample``): ``auto`` is 5000 on the CPU and all (0) on a GPU,
    where the whole kNN is cheap."""
    if setting == "auto":
        return 0 if device.type == "cuda" else 5000
    return int(setting)


def _fixed_subset(ds: Dataset, n: int, seed: int) -> Dataset:
    """``n`` samples of ``ds`` drawn once by ``seed`` (the same on every rank, every epoch and every resume), in
    dataset order; ``ds`` itself when it holds no more than ``n`` (or ``n`` is 0)."""
    size = len(ds)  # type: ignore[arg-type]
    if n <= 0 or n >= size:
        return ds
    g = torch.Generator().manual_seed(seed)
    return _subset(ds, torch.randperm(size, generator=g)[:n].sort().values.tolist())


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
        identity = OmegaConf.create({**_kwargs(cfg.data.eval_transform, ()), "mean": [0.0] * channels,
                                     "std": [1.0] * channels})
        raw = (loader_for(cfg, train_source, identity, train=False, **loading),
               loader_for(cfg, test_source, identity, train=False, **loading))
    curve, curve_k = None, None
    if k.every_n_epochs > 0:  # the curve: a fixed subsample on the CPU (eval.knn.subsample), apart from the final kNN
        n = knn_subsample(k.subsample, device)
        subsets = [_fixed_subset(s, n, cfg.seed + i) for i, s in enumerate((train_source, test_source))]
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
