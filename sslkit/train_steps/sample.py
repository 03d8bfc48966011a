"""Turn a collated batch into the model's sample dict, on the task's device."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["to_sample"]


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
