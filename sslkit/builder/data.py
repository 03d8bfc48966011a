"""The data of a run: the training source, its loader and device-side augmentation, the run's length, and the
labelled sets of the evaluations."""

from __future__ import annotations

import functools
import logging
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset, Subset

from sslkit.builder.common import preemption_signals, section_kwargs
from sslkit.builder.runtime import resolve_num_workers
from sslkit.config.rules import per_process_batch
from sslkit.config.schema import ConfigError
from sslkit.data import SSLDataset, StatefulDistributedSampler, build_loader, build_source, build_transform
from sslkit.data.device_augment import DeviceAugment, ReadForDevice, device_augment_for
from sslkit.data.device_decode import DeviceDecoder, collate_raw
from sslkit.data.loader import collate_views
from sslkit.data.remote import is_url
from sslkit.data.resolution import HighResPhase, PhasedTransform
from sslkit.data.sources import DataSourceError, counts_channels, dataset_labels
from sslkit.distributed import get_rank, get_world_size
from sslkit.evaluation.probes import stratified_split

__all__ = ["TrainData", "build_train_data", "eval_sources", "eval_specs", "fixed_subset", "high_res_phase",
           "knn_subsample", "limited", "loader_for", "open_source", "reference_sets", "select_classes",
           "with_channels"]

logger = logging.getLogger("sslkit")


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


def select_classes(ds: Dataset, classes: Any, where: str = "data.classes") -> Dataset:
    """The samples of ``ds`` whose label is one of ``classes`` (their labels and ``num_classes`` unchanged: a kNN
    over classes 5-9 still names them 5-9), or ``ds`` itself for an empty list. A source without labels, or a class
    it does not have, is a :class:`DataSourceError` naming ``where``."""
    wanted = [int(c) for c in (classes or [])]
    if not wanted:
        return ds
    num_classes = int(getattr(ds, "num_classes", 0))
    if num_classes <= 0:
        raise DataSourceError(f"{where}={wanted}: this data has no labels to select by; drop {where} or give "
                              "labelled data (a folder of class folders, a file list with labels, a preset)")
    missing = [c for c in wanted if not 0 <= c < num_classes]
    if missing:
        raise DataSourceError(f"{where}={wanted}: the data has classes 0-{num_classes - 1}, not {missing}")
    keep = torch.isin(dataset_labels(ds), torch.tensor(wanted)).nonzero().flatten()
    return _subset(ds, keep.tolist())


def open_source(cfg: DictConfig, source: str, split: str, path: str | None, kwargs: dict[str, Any],
                channels: Callable[[], int] | None = None) -> Dataset:
    """One split of a data source as every part of a run reads it: ``data.classes`` kept, then the first
    ``data.limit`` samples. A remote ``path`` (``s3://``, ``https://``, ...) brings ``data.storage_options``,
    ``data.cache_dir`` and the retries (``data.read_attempts``, ``data.read_backoff_s``) to the source. With
    ``channels`` (the trunk's input count, asked for when needed), a source left to count its channels from its own
    images (``auto``) reads that many instead: an evaluation set is read as the training images are."""
    kwargs = with_channels(source, kwargs, channels)
    if is_url(path):
        kwargs = {**kwargs, "storage_options": section_kwargs(cfg.data.storage_options, ()),
                  "cache_dir": cfg.data.cache_dir, "cache_gb": float(cfg.data.cache_gb),
                  "retries": {"attempts": cfg.data.read_attempts, "base_s": cfg.data.read_backoff_s}}
    return limited(select_classes(build_source(source, split, path, **kwargs), cfg.data.classes), cfg.data.limit)


def with_channels(source: str, kwargs: dict[str, Any], channels: Callable[[], int] | None) -> dict[str, Any]:
    """``kwargs`` with ``channels: channels()`` where ``source`` would count them from its data (``auto``)."""
    if channels is None or not counts_channels(source, kwargs):
        return kwargs
    return {**kwargs, "channels": int(channels())}


def source_channels(cfg: DictConfig) -> int:
    """The channels of the training images (``data.train``'s source opened, nothing read through the loader)."""
    return int(getattr(_source(cfg, "train"), "channels", 3))


def _source(cfg: DictConfig, split: str) -> Dataset:
    spec = cfg.data[split]
    name = spec.source or cfg.data.train.source
    path = spec.path if spec.path is not None else cfg.data.train.path
    return open_source(cfg, name, split, path, section_kwargs(spec.kwargs, ()))


def loader_for(cfg: DictConfig, source: Dataset, transform: DictConfig, *, train: bool, batch_size: int,
            workers: int, pin: bool, device_augment: DeviceAugment | None = None,
            phase: HighResPhase | None = None) -> Any:
    """A loader of ``source``; the train loader keeps its workers from epoch to epoch (the eval loaders,
    used once at the end, do not hold processes all run long). With ``device_augment`` the workers only read
    and draw each sample's augmentation parameters (:class:`~sslkit.data.device_augment.ReadForDevice`); batches
    of images of many sizes come packed (:func:`~sslkit.data.device_decode.collate_raw`). With ``phase`` (a
    high-resolution phase) the transform changes with the update each sample's key names."""
    made = ReadForDevice(device_augment.num_views, device_augment.per_channel) if device_augment is not None else \
        build_transform(transform.name, **section_kwargs(transform))
    if phase is not None:
        made = _phased(made, transform, phase)
    ds = SSLDataset(source, made, seed=cfg.seed)
    sampler = StatefulDistributedSampler(
        len(ds), num_replicas=get_world_size(), rank=get_rank(), shuffle=train, seed=cfg.seed,
        drop_last=train and cfg.data.drop_last, track_updates=phase is not None,
        groups=_shard_groups(cfg, source) if train else None, group_span=int(cfg.data.shard_span),
    )
    if sampler.groups is not None and callable(getattr(source, "plan_windows", None)):
        source.plan_windows(cfg.seed, int(cfg.data.shard_span))  # type: ignore[attr-defined]  (remote read-ahead)
    ignores = tuple(int(getattr(signal, name)) for name in preemption_signals(cfg))
    collate = functools.partial(collate_views, stack=collate_raw) if device_augment is not None else collate_views
    return build_loader(ds, batch_size, sampler, num_workers=workers, pin_memory=pin,
                        drop_last=train and cfg.data.drop_last, persistent_workers=train, worker_ignores=ignores,
                        collate_fn=collate)


def _shard_groups(cfg: DictConfig, source: Dataset) -> list[int] | None:
    """``data.order=shards``: the first sample of each of the source's shards (a sharded source's ``starts``: the
    config check refused this order for another source), for the sampler's shard-local order; None for
    ``data.order=random``."""
    if cfg.data.order != "shards":
        return None
    return [int(s) for s in source.starts[:-1]]  # type: ignore[attr-defined]


def high_res_phase(cfg: DictConfig) -> HighResPhase | None:
    """``hires.*``: the run's high-resolution phase, or None (``hires.start_step`` null)."""
    h = cfg.hires
    if h.start_step is None:
        return None
    teacher = list(h.teacher_sizes) or [cfg.gram.teacher_size] * len(h.global_sizes)
    return HighResPhase(int(h.start_step), tuple(h.global_sizes), tuple(h.local_sizes), tuple(teacher),
                        tuple(float(r) for r in h.ratios), seed=int(cfg.seed))


def _phased(base: Any, transform: DictConfig, phase: HighResPhase) -> PhasedTransform:
    """``base`` before ``phase``, then the transform section built again at each size triple of the phase (the
    local size for a multi-crop, the teacher's size where the phase has one)."""
    kwargs = section_kwargs(transform)
    made = []
    for i in range(len(phase.ratios)):
        g, loc, t = phase.sizes(i)
        sized = {**kwargs, "image_size": g}
        if "small_size" in kwargs:
            sized["small_size"] = loc
        if t is not None or "teacher_size" in kwargs:
            sized["teacher_size"] = t
        made.append(build_transform(transform.name, **sized))
    return PhasedTransform(base, phase, made)


def _device_augment(cfg: DictConfig, device: torch.device) -> DeviceAugment | None:
    """``data.augment_on``: the batch augmentation, or None where the workers augment. ``auto`` is ``device``
    wherever the training transform has a device version (else workers, said in the log): on CUDA, where the
    worker pipeline starves the GPU, and on the CPU, where it measured faster too (docs/data.md)."""
    choice = cfg.data.augment_on
    if choice == "workers":
        return None
    if cfg.hires.start_step is not None:  # augment_on=device was refused with the config
        logger.info("data: augmented in the loader workers: the crops of the high-resolution phase (hires.*) are made "
                    "there")
        return None
    try:
        augment = device_augment_for(build_transform(cfg.data.transform.name, **section_kwargs(cfg.data.transform)))
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



@dataclass
class TrainData:
    """The training data of a run and the length of the run it sets."""

    source: Dataset
    loader: Any
    device_augment: DeviceAugment | None
    device_decoder: DeviceDecoder | None
    #: loader workers per process, and whether batches are pinned
    workers: int
    pin: bool
    #: images per process and micro-batch; per optimizer step over every process and micro-batch
    batch: int
    global_batch: int
    steps_per_epoch: int
    epochs: int
    max_steps: int
    #: the high-resolution phase the loader's transform follows (``hires.*``), or None
    phase: HighResPhase | None = None


def build_train_data(cfg: DictConfig, device: torch.device, world: int) -> TrainData:
    """The training source, its loader (workers, pinning, the device augmentation and decoder) and the run's length
    in epochs and updates (``optim.max_steps`` or ``optim.epochs``)."""
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
                    "optim.micro_batches=%d)", cfg.data.global_batch_size, batch, world, cfg.optim.micro_batches)
    phase = high_res_phase(cfg)
    train_loader = loader_for(cfg, train_source, cfg.data.transform, train=True, batch_size=batch,
                              workers=workers, pin=pin, device_augment=device_augment, phase=phase)
    device_decoder = _device_decoder(cfg, train_source, device, device_augment, train_loader.dataset.describe)
    accumulate = cfg.optim.micro_batches
    steps_per_epoch = len(train_loader) // accumulate
    if steps_per_epoch == 0:
        raise _no_step(cfg, len(train_source), batch, world)  # type: ignore[arg-type]
    if cfg.optim.max_steps > 0:
        max_steps = cfg.optim.max_steps
        epochs = math.ceil(max_steps / steps_per_epoch)
    else:
        epochs = cfg.optim.epochs
        max_steps = epochs * steps_per_epoch
    return TrainData(train_source, train_loader, device_augment, device_decoder, workers, pin, batch,
                     batch * world * accumulate, steps_per_epoch, epochs, max_steps, phase)


def _no_step(cfg: DictConfig, n: int, batch: int, world: int) -> ConfigError:
    """The error of a batch larger than the training data: no optimizer step would run."""
    accumulate = cfg.optim.micro_batches
    per_step = batch * world * accumulate
    most = max(1, n // (world * accumulate))
    cut = " (data.limit keeps only those; raise it)" if 0 < cfg.data.limit <= n else ""
    fix = (f"Set data.global_batch_size={min(most, batch) * world * accumulate} or lower"
           if cfg.data.global_batch_size > 0 else f"Set data.batch_size={min(most, batch)} or lower")
    return ConfigError(
        f"data.batch_size={batch}: one optimizer step takes {batch} x {world} "
        f"process(es) x optim.micro_batches={accumulate} = {per_step} images, and the training data has "
        f"{n}{cut}: no step would run. {fix}, or use more data."
    )


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
        return {"train": (train_source, d.train.path, section_kwargs(d.train.kwargs, ()), "data.train"),
                "test": (test_source, test_path, section_kwargs(d.test.kwargs, ()), "data.test")}
    train_source = e.train.source or d.train.source
    test_source = e.test.source or train_source
    test_path = e.test.path if e.test.path is not None else (None if test_source in _OWN_TEST_PATH else e.train.path)
    test_kwargs = section_kwargs(e.test.kwargs, ()) or section_kwargs(e.train.kwargs, ())
    return {"train": (train_source, e.train.path, section_kwargs(e.train.kwargs, ()), "eval.data.train"),
            "test": (test_source, test_path, test_kwargs, "eval.data.test")}


def eval_sources(cfg: DictConfig, train_source: Dataset | None = None,
                 trunk_channels: int | None = None) -> tuple[Dataset, Dataset, int]:
    """The labelled train and test sets of kNN and the linear probe (:func:`eval_specs`), and their number of
    classes; ``train_source``, the training data already built, is used again when it is the train set. A set left
    to count its channels (``auto``) reads the trunk's: ``trunk_channels`` (a tool's trained model), else the
    training images'. Raises :class:`DataSourceError` when they have no labels or no test split, saying what to
    set."""
    specs = eval_specs(cfg)
    sets: list[Dataset] = []
    trunk = functools.cache(lambda: trunk_channels or int(getattr(train_source, "channels", 0)) or
                            source_channels(cfg))
    for split in ("train", "test"):
        source, path, kwargs, where = specs[split]
        if split == "train" and where == "data.train" and train_source is not None:
            sets.append(train_source)
            continue
        if path is None and source in _OWN_TEST_PATH:
            raise DataSourceError(f"{where}.path is not set: a {source} source needs the path of its {split} set. "
                                  f"Set {where}.path (or eval.data.train.path and eval.data.test.path for labelled "
                                  "sets of their own)")
        if split == "train":  # the training images count their own (a tool's: the trunk's); another set the trunk's
            channels = None if where == "data.train" and not trunk_channels else trunk
        else:  # the test split as the memory set is read
            memory = int(getattr(sets[0], "channels", 0))
            channels = functools.partial(int, memory) if memory else trunk
        sets.append(open_source(cfg, source, split, path, kwargs, channels))
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


def fixed_subset(ds: Dataset, n: int, seed: int) -> Dataset:
    """``n`` samples of ``ds`` drawn once by ``seed`` (the same on every rank, every epoch and every resume), in
    dataset order; ``ds`` itself when it holds no more than ``n`` (or ``n`` is 0)."""
    size = len(ds)  # type: ignore[arg-type]
    if n <= 0 or n >= size:
        return ds
    g = torch.Generator().manual_seed(seed)
    return _subset(ds, torch.randperm(size, generator=g)[:n].sort().values.tolist())


def _same_channels(ds: Dataset, want: Callable[[], int], where: str) -> None:
    """Stop on a reference set whose images have another channel count than ``want()``, the training images' (the
    trunk's input), naming the set and the key that sets it."""
    have = getattr(ds, "channels", None)
    if have is None:
        return
    trunk = want()
    if int(have) != trunk:
        raise DataSourceError(f"{where}: its images have {have} channel(s) and the trunk reads {trunk} (the training "
                              f"images'): give the set kwargs: {{channels: {trunk}}} (the sources convert grey to RGB "
                              "and RGB to grey), or images of that many channels")


def reference_sets(cfg: DictConfig) -> list[tuple[str, Dataset, Dataset, int]]:
    """``eval.reference.sets``: per set ``(name, memory, queries, num_classes)``, the set's samples (``samples``
    drawn by ``eval.reference.seed``; 0: all) of its source's ``split`` (``test`` by default; the source, path and
    kwargs by default the run's own for that split) of its ``classes`` (all by default; ``data.classes`` does not
    apply), halved by class into the kNN's memory and queries. Raises :class:`DataSourceError` naming the set when
    its data has no labels, too few samples or another channel count than the training images'."""
    r = cfg.eval.reference
    found = []
    trunk_channels = functools.cache(lambda: source_channels(cfg))  # the training source opened once, if asked
    for i, entry in enumerate(OmegaConf.to_container(r.sets, resolve=True) or []):  # type: ignore[union-attr]
        name = str(entry["name"])
        where = f"eval.reference.sets[{i}] ({name})"
        split = str(entry.get("split", "test"))
        run = cfg.data[split] if split in ("train", "test") else cfg.data.train  # how the run reads that split
        run_source = run.source or cfg.data.train.source
        source = entry.get("source") or run_source
        same = source == run_source
        path = entry.get("path", (run.path if run.path is not None else cfg.data.train.path) if same else None)
        given = entry.get("kwargs")
        kwargs = dict(given if given is not None else section_kwargs(run.kwargs, ()) if same else {})
        ds = build_source(source, split, path, **with_channels(source, kwargs, trunk_channels))
        if int(getattr(ds, "num_classes", 0)) <= 0:
            raise DataSourceError(f"{where}: {source}{', ' + str(path) if path else ''} has no labels, and a "
                                  "reference set is classified by kNN: give labelled images (a folder of class "
                                  "folders, a file list with labels, a preset)")
        _same_channels(ds, trunk_channels, where)
        ds = fixed_subset(select_classes(ds, entry.get("classes"), f"{where}.classes"),
                          int(entry.get("samples", 2000)), int(r.seed) + i)
        labels = dataset_labels(ds)
        if len(labels) < 4:
            raise DataSourceError(f"{where}: {len(labels)} labelled samples; a reference set needs a few per class "
                                  "(its halves are the kNN's neighbours and queries)")
        memory, queries = stratified_split(labels, 0.5, int(r.seed) + i)
        found.append((name, _subset(ds, memory.tolist()), _subset(ds, queries.tolist()),
                      int(getattr(ds, "num_classes", 0))))
    return found
