"""Prepares the next train batch (copy to the device, decode, augmentation) on a side CUDA stream during the step.

:class:`Prefetcher` wraps a phase's batch iterator. Each ``next()`` hands over the batch prepared
one call earlier and queues the preparation of the following one on its own CUDA stream, so that
the host-to-device copy of batch k+1 (from pinned memory), its JPEG decode and its augmentation run
on the GPU while the model's kernels of step k run on the default stream. The default stream waits
for the side stream's event before it reads the batch, and the batch's tensors are recorded on it
(``record_stream``), so the caching allocator does not hand their memory back to the side stream
while the step still reads them. On the CPU the same object prepares one batch ahead in line: the
order of work and the results are those of CUDA, and the tests run this code.

The prefetcher counts the batches it hands over (:attr:`Prefetcher.position`, from the phase's start), so
the sample stage can check that a step reads one batch per micro-batch. It changes when a batch is
prepared, never what it is: each sample brings its own augmentation parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Prefetcher"]


def _record(x: Any, stream: torch.cuda.Stream) -> None:
    """``record_stream`` on every CUDA tensor in ``x`` (nested lists, tuples, dicts, objects with tensors)."""
    if isinstance(x, torch.Tensor):
        if x.is_cuda:
            x.record_stream(stream)
    elif isinstance(x, list | tuple):
        for v in x:
            _record(v, stream)
    elif isinstance(x, dict):
        for v in x.values():
            _record(v, stream)


class Prefetcher:
    """An iterator of prepared samples: ``prepare(batch)`` of each batch of ``batches``, one ahead.

    :attr:`position` counts the batches handed over from ``start`` (the phase's first micro-batch after a
    resume). On a
    CUDA ``device`` the preparation runs on a side stream; elsewhere in line. ``StopIteration`` comes when
    the batch after the last is asked for, as from the wrapped iterator.
    """

    def __init__(self, batches: Iterator[Any], prepare: Callable[[Any], Any], device: torch.device,
                 start: int = 0) -> None:
        """Wrap ``batches``; nothing is read before the first ``next()``."""
        self.batches = batches
        self.prepare = prepare
        self.position = start  # of the batch the next ``next()`` returns
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ahead: tuple[Any, torch.cuda.Event | None] | None = None
        self._started = False
        self._exhausted = False

    def __iter__(self) -> Prefetcher:
        """Itself."""
        return self

    def _prepare_next(self) -> None:
        """Read the next batch and queue its preparation (on the side stream on CUDA)."""
        try:
            batch = next(self.batches)
        except StopIteration:
            self._ahead, self._exhausted = None, True
            return
        if self.stream is None:
            self._ahead = (self.prepare(batch), None)
            return
        with torch.cuda.stream(self.stream):
            sample = self.prepare(batch)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._ahead = (sample, event)

    def __next__(self) -> Any:
        """The prepared batch at :attr:`position`; queues the next one's preparation before returning."""
        if not self._started:
            self._started = True
            self._prepare_next()
        if self._exhausted or self._ahead is None:
            raise StopIteration
        sample, event = self._ahead
        if event is not None:
            current = torch.cuda.current_stream()
            current.wait_event(event)
            _record(sample, current)
        self.position += 1
        self._prepare_next()
        return sample
