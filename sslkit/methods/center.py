"""The moving centre of a teacher's logits (DINO's CLS centre, iBOT's patch centre): sums over an update's
micro-batches, one all-reduce, one exponential moving average per optimizer update."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from sslkit.distributed import all_reduce_sum

__all__ = ["Center"]


class Center(nn.Module):
    """``c <- m c + (1 - m) sum_i w_i t_i / sum_i w_i``, once per optimizer update.

    The mean runs over every row ``t_i`` of the teacher logits given to :meth:`accumulate` since the last
    :meth:`update`: every crop of every micro-batch of the update on every rank (the weighted sums and the weight
    are gathered over the micro-batches and all-reduced once, in :meth:`update`; no collective on one process), so
    a run with gradient accumulation or several ranks moves the centre as one process with the whole batch does.
    Without weights every row counts once (DINO's CLS centre: the mean over the global crops, Caron et al. 2021,
    eq. 4); with them, a row counts by its weight (iBOT's and DINOv2's patch centre: 1 on a masked patch, 0 on
    padding). An update that gathered no weight leaves the centre as it is. The product ``m c`` is rounded, then
    ``(1 - m)`` times the mean is added in one fused step (``torch.add(..., alpha=1 - m)``).

    ``value`` ``[1, dim]`` is the centre (a buffer: saved with the loss); the pending sums are not saved, since a
    checkpoint is written between updates, when they are empty.
    """

    value: torch.Tensor
    _pending: torch.Tensor

    def __init__(self, dim: int, momentum: float = 0.9) -> None:
        super().__init__()
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"dino center_momentum must be in [0, 1], got {momentum}")  # (loss.center_momentum)
        self.momentum = float(momentum)
        self.register_buffer("value", torch.zeros(1, dim))
        # the weighted sum of the rows and the total weight over this update's micro-batches so far
        self.register_buffer("_pending", torch.zeros(dim + 1), persistent=False)

    @torch.no_grad()
    def accumulate(self, logits: Sequence[torch.Tensor], weights: Sequence[torch.Tensor] | None = None) -> None:
        """Add this micro-batch's teacher logits: a list of ``[..., K]`` tensors (one per crop, or one for all), each
        row with the weight of ``weights`` (same list, ``[...]``), or 1."""
        if weights is None:
            t = torch.cat([x.reshape(-1, x.shape[-1]) for x in logits]).detach().float()
            self._pending[:-1] += t.sum(dim=0)
            self._pending[-1] += t.shape[0]
            return
        for t, w in zip(logits, weights, strict=True):
            w = w.float().reshape(-1, 1)
            self._pending[:-1] += (t.detach().float().reshape(w.shape[0], -1) * w).sum(dim=0)
            self._pending[-1] += w.sum()

    @torch.no_grad()
    def update(self) -> None:
        """Move the centre to the mean gathered since the last update (all ranks); forget the sums."""
        stats = all_reduce_sum(self._pending.clone())
        count = stats[-1]
        mean = (stats[:-1] / count.clamp(min=1.0)).unsqueeze(0)
        moved = torch.add(self.value * self.momentum, mean, alpha=1.0 - self.momentum)
        self.value.copy_(torch.where(count > 0, moved, self.value))
        self._pending.zero_()
