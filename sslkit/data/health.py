"""Counting unreadable samples per epoch from the batches' ``data_valid``, on device, for a report at epoch end."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from sslkit.data.sources import DataSourceError

__all__ = ["SkipTotals", "SkippedSamples"]


class SkipTotals(NamedTuple):
    """An epoch's counts: samples ``skipped`` (unreadable, replaced), samples ``seen``, and
    ``empty_batches``, the batches in which no sample at all was readable."""

    skipped: int
    seen: int
    empty_batches: int


class SkippedSamples:
    """Count the unreadable samples of one epoch without a host-device sync per step.

    :class:`~sslkit.data.SSLDataset` replaces an unreadable sample by the next readable one and
    marks it ``valid`` False; the batch carries that as ``data_valid``. Counting from the batch,
    in the main process, works whatever ``data.num_workers`` is (the dataset object itself lives
    in the worker processes, so a count kept there never reaches the main process).

    Use from a hook::

        on_phase_start:  counter.reset(task.device)
        on_step:         counter.update(task.last_batch.sample)      # device ops only, no sync
        on_phase_end:    message = counter.report(task.epoch)         # every rank: one all-reduce + sync
                         if message: logger.warning(message)
                         counter.check_all_unreadable(task.epoch)     # raises DataSourceError if nothing was read

    :attr:`counts` is an int64 tensor ``[skipped, seen, empty_batches]`` on the device of the
    last reset (or of the first batch).
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        """Start at zero; ``device`` is where the counts live (None: the device of the first batch)."""
        self.counts = torch.zeros(3, dtype=torch.int64)
        self._device: torch.device | None = None
        self._totals: SkipTotals | None = None
        self.reset(device)

    def reset(self, device: torch.device | str | None = None) -> None:
        """Zero the counts for a new epoch; ``device`` as in the constructor."""
        self._device = None if device is None else torch.device(device)
        self.counts = torch.zeros(3, dtype=torch.int64, device=self._device)
        self._totals = None

    def update(self, sample: Mapping[str, Any] | torch.Tensor) -> None:
        """Add one batch: ``sample`` is the batch dict (its ``data_valid``) or the bool tensor itself.

        A batch without ``data_valid`` counts as all readable. Runs on device, without a sync.
        """
        valid = sample if isinstance(sample, torch.Tensor) else sample.get("data_valid")
        if valid is None:
            return
        valid = valid.reshape(-1)
        if self._device is None:  # follow the batches' device from the first one on
            self._device = valid.device
            self.counts = self.counts.to(self._device)
        invalid = ~valid.to(device=self.counts.device, dtype=torch.bool)
        self.counts[0] += invalid.sum()
        self.counts[1] += invalid.numel()
        if invalid.numel():
            self.counts[2] += invalid.all()
        self._totals = None

    def totals(self, across_ranks: bool = True) -> SkipTotals:
        """The counts on the host, summed over all processes if ``across_ranks`` (a collective:
        then every rank must call it). One host-device sync; the result is cached until the next
        :meth:`update` or :meth:`reset`."""
        if self._totals is None:
            counts = self.counts
            if across_ranks:
                from sslkit.distributed import all_reduce_sum

                counts = all_reduce_sum(counts)
            skipped, seen, empty = (int(v) for v in counts.tolist())
            self._totals = SkipTotals(skipped, seen, empty)
        return self._totals

    def report(self, epoch: int, across_ranks: bool = True) -> str | None:
        """A one-line report of the epoch's unreadable samples, or None if there were none.

        E.g. ``"epoch 3: 12 of 50000 samples (0.02%) were unreadable and replaced by the next
        readable one; 1 batch had no readable sample; the file names are in the warnings above"``.
        ``across_ranks`` as in :meth:`totals`.
        """
        t = self.totals(across_ranks)
        if t.skipped == 0:
            return None
        msg = (f"epoch {epoch}: {t.skipped} of {t.seen} samples ({100.0 * t.skipped / max(t.seen, 1):.2f}%) "
               "were unreadable and replaced by the next readable one")
        if t.empty_batches:
            msg += f"; {t.empty_batches} batch{'es' if t.empty_batches != 1 else ''} had no readable sample"
        return msg + "; the file names are in the warnings above"

    def check_all_unreadable(self, epoch: int, across_ranks: bool = True) -> None:
        """Raise :class:`DataSourceError` if the epoch saw samples and every one was unreadable.

        Then training ran on substitutes only (copies of the few readable files outside the
        epoch's indices): stop rather than train on that. ``across_ranks`` as in :meth:`totals`.
        """
        t = self.totals(across_ranks)
        if t.seen and t.skipped == t.seen:
            raise DataSourceError(
                f"epoch {epoch}: all {t.seen} samples were unreadable (corrupt, truncated or not images); "
                "the warnings above name the files. Check or re-copy the data."
            )

    def state_dict(self) -> dict[str, list[int]]:
        """The counts of this process so far (for a mid-epoch checkpoint; syncs)."""
        return {"counts": [int(v) for v in self.counts.tolist()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counts from :meth:`state_dict`, on the current device."""
        self.counts = torch.tensor(list(state["counts"]), dtype=torch.int64, device=self.counts.device)
        self._totals = None
