"""CollapseMonitorHook: the per-dimension std of L2-normalised embeddings, healthy near 1/sqrt(d), collapsed near 0."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sslkit.hooks.base import Slot, SSLHook
from sslkit.registry import register_hook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["CollapseMonitorHook", "embedding_std"]


def embedding_std(z: torch.Tensor) -> torch.Tensor:
    """Mean over dimensions of the std over the batch of the L2-normalised rows of ``z`` [B, d].

    For embeddings spread uniformly on the sphere it is close to ``1/sqrt(d)``; if every sample
    maps to the same point it is 0 (SimSiam, Chen & He 2021, section 4.1).
    """
    return F.normalize(z.detach().float(), dim=1).std(dim=0).mean()


@register_hook("collapse_monitor")
class CollapseMonitorHook(SSLHook):
    """Adds ``embedding_std`` (and ``embedding_std_ratio`` = std * sqrt(d), ~1 healthy) of the
    first view's ``output[key]`` to ``task.last_batch.metrics`` each train step; the log hook
    writes them at its interval. Computed on the device: no sync.
    """

    name = "collapse_monitor"
    slot = Slot.MONITOR

    def __init__(self, key: str = "projections") -> None:
        self.key = key

    def on_forward(self, task: SSLTask) -> None:
        """Measure the spread of this step's embeddings."""
        if not task.train or task.last_batch is None:
            return
        out = task.last_batch.model_output[self.key]
        z = out[0] if isinstance(out, list | tuple) else out
        std = embedding_std(z)
        task.last_batch.metrics["embedding_std"] = std
        task.last_batch.metrics["embedding_std_ratio"] = std * z.shape[1] ** 0.5
