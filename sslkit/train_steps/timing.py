"""The step's section timers (read_sample, forward, backward, ...): host time on the CPU, CUDA events on a GPU."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["PerfStats"]


class PerfStats:
    """Timers per step section, true on a GPU without syncing the step.

    On the CPU a section's time is the host's wall-clock time in it. On CUDA, where kernels run
    after the host has queued them, host time would be charged to whichever section happens to
    wait (the first sync), so each section records a pair of CUDA events on the current stream
    instead: its time is the GPU's time between them, which holds the kernels the section
    queued and, for ``read_sample``, the time the GPU sat idle waiting for data. The events are
    read only when asked (:meth:`resolve`: by :meth:`table` at phase end and by the log hook at
    its interval, where it syncs anyway), never inside a step.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._pending: list[tuple[str, Any, Any]] = []  # (section, start event, end event) not read yet
        self._free: list[Any] = []  # events read already, for reuse

    def _event(self) -> Any:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Add the time spent in the ``with`` block to section ``name``."""
        self.counts[name] = self.counts.get(name, 0) + 1
        if self.cuda:
            start = self._event()
            try:
                yield
            finally:
                self._pending.append((name, start, self._event()))
            return
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - begin

    def resolve(self) -> None:
        """Read the CUDA events recorded so far into :attr:`totals` (waits for the last one: a sync)."""
        if not self._pending:
            return
        self._pending[-1][2].synchronize()
        for name, start, end in self._pending:
            self.totals[name] = self.totals.get(name, 0.0) + start.elapsed_time(end) / 1000.0
            self._free += (start, end)
        self._pending.clear()

    def reset(self) -> None:
        """Forget all timings (called at phase start)."""
        self._free += [e for _, start, end in self._pending for e in (start, end)]
        self._pending.clear()
        self.totals.clear()
        self.counts.clear()

    def table(self) -> str:
        """A text table: section, calls, total seconds, mean milliseconds, share of the total."""
        self.resolve()
        total = sum(self.totals.values()) or 1.0
        clock = "GPU time per section (CUDA events)" if self.cuda else "host time per section"
        lines = [clock, f"{'section':<18}{'calls':>8}{'total s':>10}{'mean ms':>10}{'share':>8}"]
        for name, secs in self.totals.items():
            n = self.counts[name]
            lines.append(f"{name:<18}{n:>8}{secs:>10.2f}{1000 * secs / n:>10.2f}{secs / total:>8.1%}")
        return "\n".join(lines)
