"""Batch collation for multi-view samples and the DataLoader builder."""

from __future__ import annotations

import atexit
import contextlib
import functools
import signal
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from sslkit.data.dataset import SSLDataset
from sslkit.data.sampler import StatefulDistributedSampler
from sslkit.data.seeding import mix_seed

__all__ = ["SignalSafeLoader", "build_loader", "collate_views", "ignore_signals_in_worker", "position_loader",
           "signals_blocked"]


def collate_views(batch: list[dict[str, Any]],
                  stack: Callable[[list[torch.Tensor]], Any] = torch.stack) -> dict[str, Any]:
    """Stack :class:`SSLDataset` samples into a batch.

    Returns ``input`` (one ``[B,C,H,W]`` tensor per view, so views of different sizes are
    fine; ``stack`` makes it, e.g. :func:`~sslkit.data.device_decode.collate_raw` for images as read),
    ``target`` (int64 labels), ``data_valid`` (bool; False for an unreadable sample that was replaced,
    counted per epoch by :class:`~sslkit.data.health.SkippedSamples`) and ``data_idx``
    (int64 indices); with samples that carry ``teacher_views`` (crops only a teacher sees), ``teacher_input`` stacked
    like ``input``.
    """
    if not batch:
        raise ValueError("cannot collate an empty batch")
    num_views = len(batch[0]["views"])
    if any(len(b["views"]) != num_views for b in batch):
        raise ValueError(f"samples in a batch have different numbers of views: {[len(b['views']) for b in batch]}")
    out = {
        "input": [stack([b["views"][v] for b in batch]) for v in range(num_views)],
        "target": torch.tensor([b["label"] for b in batch], dtype=torch.int64),
        "data_valid": torch.tensor([b["valid"] for b in batch], dtype=torch.bool),
        "data_idx": torch.tensor([b["index"] for b in batch], dtype=torch.int64),
    }
    if "teacher_views" in batch[0]:
        out["teacher_input"] = [stack([b["teacher_views"][v] for b in batch])
                                for v in range(len(batch[0]["teacher_views"]))]
    return out


def ignore_signals_in_worker(signals: tuple[int, ...], _worker_id: int) -> None:
    """``worker_init_fn``: a data worker ignores ``signals`` (the pre-emption signals), so that one sent to the
    whole process group (a terminal's Ctrl-C, a scheduler) does not kill it under the main process, which
    finishes its step, checkpoints and then stops the workers itself. Workers still end when the loader
    shuts down, and on their own shortly after the main process is gone.

    The workers start with these signals blocked (:class:`SignalSafeLoader`), so one that arrives while a
    worker is still starting (a spawned worker imports torch first) waits, and is dropped here."""
    for s in signals:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


@contextlib.contextmanager
def signals_blocked(signals: tuple[int, ...]) -> Iterator[None]:
    """Block ``signals`` in this thread for the ``with`` block (main thread only; elsewhere nothing is done).
    A signal that arrives meanwhile is delivered when the block ends."""
    if not signals or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


#: Iterators of :class:`SignalSafeLoader` with worker processes, shut down at exit (:func:`_shutdown_at_exit`).
_LIVE_ITERATORS: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    """Stop the workers of every loader iterator still alive at interpreter exit. Workers ignore SIGTERM (the
    pre-emption signals), and multiprocessing's own exit handler (registered earlier, so it runs after this
    one) would terminate them with it and then wait for them forever: an iterator kept alive by a reference
    cycle, or a script that never closed its task, would hang the exit."""
    for iterator in list(_LIVE_ITERATORS):
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            with contextlib.suppress(Exception):
                shutdown()


class SignalSafeLoader(DataLoader):
    """A DataLoader whose worker processes start with the pre-emption signals blocked (they inherit the
    mask), so no worker dies of a group signal before :func:`ignore_signals_in_worker` has run; their
    iterators are stopped at interpreter exit if nothing stopped them before."""

    worker_ignores: tuple[int, ...] = ()

    def __iter__(self) -> Any:
        """Start (or reuse) the workers with :attr:`worker_ignores` blocked in this process meanwhile."""
        with signals_blocked(self.worker_ignores if self.num_workers > 0 else ()):
            iterator = super().__iter__()
        if self.num_workers > 0:
            _LIVE_ITERATORS.add(iterator)
        return iterator


def build_loader(
    dataset: SSLDataset,
    batch_size: int,
    sampler: StatefulDistributedSampler,
    num_workers: int,
    pin_memory: bool = False,
    drop_last: bool = True,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    worker_ignores: tuple[int, ...] = (),
    collate_fn: Callable[[list[dict[str, Any]]], dict[str, Any]] = collate_views,
) -> DataLoader:
    """A DataLoader over ``dataset`` drawing ``(epoch, index)`` keys from ``sampler``.

    ``persistent_workers`` and ``prefetch_factor`` apply only with ``num_workers > 0``. Note that
    persistent workers keep the dataset object of their first epoch. The workers ignore the
    signals in ``worker_ignores`` (:func:`ignore_signals_in_worker`). ``collate_fn`` makes the batches
    (:func:`collate_views`).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    kwargs: dict[str, Any] = {}
    if num_workers > 0:
        kwargs["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
        if worker_ignores:
            ignored = tuple(int(s) for s in worker_ignores)
            kwargs["worker_init_fn"] = functools.partial(ignore_signals_in_worker, ignored)
    loader = SignalSafeLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        drop_last=drop_last,
        **kwargs,
    )
    loader.worker_ignores = tuple(int(s) for s in worker_ignores)
    return loader


def position_loader(loader: DataLoader, seed: int, epoch: int, start_batch: int = 0, update: int | None = None,
                    batches_per_update: int = 1) -> None:
    """Put ``loader`` where a run stands before an iterator is opened on it: the base seed of its workers drawn from
    a generator of its own seeded by ``(seed, epoch)`` (without one, DataLoader draws it from the global torch RNG
    at every ``iter()`` and a resumed run would diverge), its sampler at ``epoch`` and at the sample of batch
    ``start_batch`` (a resume inside the epoch), and, in a train phase (``update`` given) with a sampler that
    tracks them, each sample's optimizer update numbered from ``update`` (``batches_per_update`` batches each)."""
    sampler = loader.sampler
    if loader.generator is None:
        loader.generator = torch.Generator()
    loader.generator.manual_seed(mix_seed(seed, epoch))
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    if hasattr(sampler, "set_start"):
        sampler.set_start(start_batch * (loader.batch_size or 1))
    if update is not None and getattr(sampler, "track_updates", False):
        sampler.updates_from(update, batches_per_update * (loader.batch_size or 1))
