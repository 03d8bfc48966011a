"""A distributed sampler that reshuffles per epoch and resumes mid-epoch from a checkpoint."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = ["StatefulDistributedSampler", "grouped_order", "shard_windows"]

logger = logging.getLogger("sslkit.data")


class StatefulDistributedSampler(Sampler[tuple[int, ...]]):
    """Shard a dataset over ``num_replicas`` ranks; yield ``(epoch, index)`` pairs.

    Each epoch permutes ``range(dataset_len)`` with a generator seeded by ``seed + epoch`` (every
    rank computes the same permutation), pads it by repeating from its start (``drop_last=False``)
    or truncates it (``drop_last=True``) to a multiple of ``num_replicas``, and gives rank ``r``
    the positions ``r, r + num_replicas, ...``. :meth:`set_start` skips the samples this rank
    already consumed in the current epoch, so training resumes exactly where it stopped.
    """

    def __init__(
        self,
        dataset_len: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        track_updates: bool = False,
        groups: list[int] | None = None,
        group_span: int = 1,
    ) -> None:
        """Sample ``dataset_len`` indices for ``rank`` of ``num_replicas``; with ``track_updates``, yield
        ``(epoch, index, update)`` (:meth:`updates_from`). ``groups`` (the first index of each group of
        consecutive samples: a source's shards) makes each epoch's order shard-local (:func:`grouped_order`)."""
        if dataset_len < 0:
            raise ValueError(f"dataset_len must be >= 0, got {dataset_len}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need num_replicas >= 1 and 0 <= rank < num_replicas, got {rank}, {num_replicas}")
        self.dataset_len = int(dataset_len)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.start = 0
        self.track_updates = bool(track_updates)
        if groups is not None and (not groups or groups[0] != 0 or list(groups) != sorted(groups)
                                   or groups[-1] > dataset_len or group_span < 1):
            raise ValueError(f"groups must be ascending group starts from 0 within {dataset_len}, and group_span "
                             f">= 1; got {groups[:5]}..., {group_span}")
        self.groups = [int(g) for g in groups] if groups is not None else None
        self.group_span = int(group_span)
        #: the update the first sample of the next iteration trains, and the samples of this rank per update
        self.first_update, self.per_update = 0, 1

    @property
    def num_samples(self) -> int:
        """Samples this rank gets in a full epoch."""
        if self.drop_last:
            return self.dataset_len // self.num_replicas
        return -(-self.dataset_len // self.num_replicas)

    @property
    def total_size(self) -> int:
        """Samples all ranks together get in a full epoch (padded or truncated)."""
        return self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch``; a change of epoch resets the start to 0.

        Setting the epoch already set keeps the start, so a trainer may call ``set_epoch`` at
        the top of every epoch, including the one it resumes from a checkpoint.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.start = 0
        self.epoch = int(epoch)

    def set_start(self, start: int) -> None:
        """Skip the first ``start`` of this rank's samples of the current epoch (already consumed)."""
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"start must be in [0, {self.num_samples}], got {start}")
        self.start = int(start)

    def updates_from(self, first_update: int, per_update: int) -> None:
        """The next iteration's first sample belongs to update ``first_update``, and each update takes
        ``per_update`` of this rank's samples (batch x micro-batches): with ``track_updates`` each key then names
        its update, so a transform that changes with the update (a high-resolution phase) gives a whole batch the
        same crops on every rank, and a resumed run the crops it had."""
        if first_update < 0 or per_update < 1:
            raise ValueError(f"need first_update >= 0 and per_update >= 1, got {first_update}, {per_update}")
        self.first_update, self.per_update = int(first_update), int(per_update)

    def epoch_indices(self, epoch: int | None = None) -> list[int]:
        """All of this rank's indices for ``epoch`` (default: the current one), ignoring the start."""
        epoch = self.epoch if epoch is None else epoch
        n = self.dataset_len
        if self.shuffle and self.groups is not None:
            order = grouped_order(n, self.groups, self.group_span, self.seed + epoch)
        elif self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(n)
        total = self.total_size
        if total > n:  # pad by repeating from the start (as often as needed for tiny datasets)
            order = order.repeat(-(-total // n))
        return order[:total][self.rank :: self.num_replicas].tolist()

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        """Yield ``(epoch, index)`` for this rank's remaining samples of the current epoch (``(epoch, index,
        update)`` with ``track_updates``)."""
        epoch = self.epoch
        if not self.track_updates:
            for index in self.epoch_indices(epoch)[self.start :]:
                yield epoch, index
            return
        for i, index in enumerate(self.epoch_indices(epoch)[self.start :]):
            yield epoch, index, self.first_update + i // self.per_update

    def __len__(self) -> int:
        """Samples left in the current epoch from the start."""
        return self.num_samples - self.start

    def state_dict(self) -> dict[str, Any]:
        """Epoch and start, with the settings that give them their meaning."""
        return {
            "epoch": self.epoch,
            "start": self.start,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "num_replicas": self.num_replicas,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore epoch and start.

        With a different number of replicas the start is rescaled so the same global position in
        the epoch's permutation is resumed (up to ``num_replicas - 1`` samples seen again); if the
        dataset length, seed or shuffling changed, the epoch restarts from 0 with a warning.
        """
        self.epoch = int(state["epoch"])
        start = int(state.get("start", 0))
        same_order = all(state.get(k, getattr(self, k)) == getattr(self, k) for k in ("seed", "dataset_len", "shuffle"))
        old_replicas = int(state.get("num_replicas", self.num_replicas))
        if not same_order:
            logger.warning(
                "sampler state is from a different dataset length/seed/shuffle (%s); restarting epoch %d "
                "from its beginning",
                {k: state.get(k) for k in ("seed", "dataset_len", "shuffle")},
                self.epoch,
            )
            start = 0
        elif old_replicas != self.num_replicas:
            start = start * old_replicas // self.num_replicas
        self.start = min(start, self.num_samples)


def grouped_order(n: int, starts: list[int], span: int, seed: int) -> torch.Tensor:
    """A permutation of ``range(n)`` that reads groups of consecutive samples (a source's shards, starting at
    ``starts``) ``span`` at a time: the groups are shuffled, taken ``span`` by ``span`` in that order, and the samples
    of each such window shuffled among themselves (all from ``seed``). An epoch then visits each shard in one window,
    so its reads stay within ``span`` shards at a time (their pages in the cache, read ahead), at the price of
    batches mixing ``span`` shards instead of the whole dataset. A function of the seed alone: every rank, any number
    of processes and a resumed run compute the same order."""
    g = torch.Generator().manual_seed(seed)
    bounds = list(starts) + [n]
    pieces = []
    for shards in _windows(len(starts), span, g):
        window = torch.cat([torch.arange(bounds[k], bounds[k + 1]) for k in shards])
        pieces.append(window[torch.randperm(len(window), generator=g)])
    return torch.cat(pieces) if pieces else torch.arange(0)


def shard_windows(num_shards: int, span: int, seed: int) -> list[list[int]]:
    """The windows of shards :func:`grouped_order` reads for ``seed`` (the sampler's seed + the epoch), in order: what
    a source that fetches whole shards reads ahead from."""
    return _windows(num_shards, span, torch.Generator().manual_seed(seed))


def _windows(num_shards: int, span: int, g: torch.Generator) -> list[list[int]]:
    """The shards shuffled by ``g``'s next draw, ``span`` at a time."""
    shards = torch.randperm(num_shards, generator=g).tolist()
    return [shards[w:w + span] for w in range(0, len(shards), span)]
