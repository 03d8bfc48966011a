"""The phase's samples: a collated batch made the model's sample dict on the task's device (copied, decoded,
augmented and masked there), and the iterator a phase reads them from, chosen when the phase starts."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from sslkit.data.device_augment import Images
from sslkit.data.device_decode import DeviceDecoder, RawImages
from sslkit.data.prefetch import Prefetcher

__all__ = ["SampleTask", "augment_on_device", "phase_samples", "prepare_sample", "to_sample"]

#: Images of many sizes that the workers decoded: copied to the device and packed (no JPEG to decode).
_PACK_ONLY = DeviceDecoder(channels=3)


def _move(x: Any, device: torch.device, channels_last: bool) -> Any:
    if isinstance(x, torch.Tensor):
        # Copy first, then change the layout on the device: a layout change on the host would make a new,
        # unpinned tensor, and the copy from it could no longer overlap with the GPU's work.
        x = x.to(device, non_blocking=True)
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x
    if isinstance(x, list | tuple):
        return [_move(v, device, channels_last) for v in x]
    if isinstance(x, dict):
        return {k: _move(v, device, channels_last) for k, v in x.items()}
    return x


def to_sample(batch: dict[str, Any], device: torch.device, channels_last: bool = False) -> dict[str, Any]:
    """Return ``{"input", "target", "data_valid", "data_idx", ...}`` with tensors on ``device``.

    ``input`` stays a list of view tensors (multi-input nests under ``input``); other keys of
    the batch pass through unchanged, moved to the device when they are tensors. The copies are
    non-blocking: from pinned memory (``data.pin_memory``) they overlap with the GPU's work.
    """
    if "input" not in batch:
        raise KeyError(f"a batch must have an 'input' key; it has {sorted(batch)}")
    sample = _move(batch, device, channels_last)
    if isinstance(sample["input"], torch.Tensor):
        sample["input"] = [sample["input"]]
    return sample


class SampleTask(Protocol):
    """What making a phase's samples reads of the task (:class:`sslkit.task.SSLTask` has it; this module does not
    import it)."""

    train: bool
    epoch: int
    device: torch.device
    channels_last: bool
    device_augment: Any
    device_decoder: Any
    masking: Any
    perf_stats: Any


def prepare_sample(task: SampleTask, batch: dict[str, Any]) -> dict[str, Any]:
    """A train batch made the model's sample: copied to the device (non-blocking from pinned memory) and, with
    ``data.augment_on=device``, decoded and augmented there (each sample brings its own uniforms); with
    ``masking``, each view's masks drawn there too (``sample["masks"]``: from every sample's seed, epoch and
    index, :class:`~sslkit.models.masking.MaskPlan`)."""
    device_side = task.device_augment is not None
    sample = to_sample(batch, task.device, task.channels_last and not device_side)
    if device_side:
        images, uniforms = sample["input"]
        if isinstance(images, RawImages):  # images of many sizes, JPEGs as bytes
            with task.perf_stats.timer("decode"):
                decoder = task.device_decoder or _PACK_ONLY
                images = decoder(images, sample, task.device)
        with task.perf_stats.timer("augment"):
            sample["input"] = augment_on_device(task, images, uniforms)
    if task.masking is not None:
        with task.perf_stats.timer("mask"):
            sample["masks"] = task.masking(sample["input"], sample["data_idx"], task.epoch)
    return sample


def augment_on_device(task: SampleTask, images: Images, uniforms: torch.Tensor) -> list[torch.Tensor]:
    """``data.augment_on=device``: the views of a batch of images as read, augmented on the task's device with
    each sample's uniforms ``[N, views, 54]``, which the loader workers drew from (seed, epoch, index) as the
    per-image transform draws them: a sample's views do not depend on its batch, the number of processes or a
    resume (nothing to checkpoint), and match the workers pipeline's parameter for parameter."""
    views = task.device_augment.apply(images, uniforms)
    if task.channels_last:
        views = [v.contiguous(memory_format=torch.channels_last) for v in views]
    return views


def phase_samples(task: SampleTask, batches: Iterator[dict[str, Any]], start: int) -> Iterator[dict[str, Any]]:
    """What a phase reads its samples from, chosen when it starts: in train phases a
    :class:`~sslkit.data.prefetch.Prefetcher` that prepares the next batch (:func:`prepare_sample`; on a side CUDA
    stream, on the CPU one batch ahead in line) and counts the batches from ``start`` (the phase's micro-batch
    after a resume); in eval phases each batch copied to the device as it is read."""
    if not task.train:
        return map(functools.partial(to_sample, device=task.device, channels_last=task.channels_last), batches)
    # a weak reference: the task holds the prefetcher, which must not hold the task (a cycle would keep the
    # loader's iterator, and its worker processes, alive until a garbage collection)
    return Prefetcher(batches, functools.partial(prepare_sample, weakref.proxy(task)), task.device, start=start)
