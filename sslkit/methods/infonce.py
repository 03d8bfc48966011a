"""The cross entropy of contrastive logits, written so that it is deterministic and sync-free on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cross_entropy_at"]


def cross_entropy_at(logits: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``-log softmax(logits[i])[positive[i]]``: ``F.cross_entropy(logits, positive)``.

    Written as ``-log_softmax(logits)`` read at the positive column with ``gather`` rather than
    through ``F.cross_entropy``: PyTorch documents ``NLLLoss`` on CUDA as an operation that raises
    under ``torch.use_deterministic_algorithms(True)`` (``machine.deterministic=true``), while
    ``log_softmax`` and ``gather`` have deterministic CUDA kernels. ``log_softmax`` is what
    ``F.cross_entropy`` computes first, so the value keeps its accuracy also for a loss near 0
    (``logsumexp(x) - x_pos`` would cancel there); no host-device sync. ``logits`` [N, C] (any
    float dtype; computed in float32), ``positive`` [N] int64 column indices on the same device.
    """
    log_p = F.log_softmax(logits.float(), dim=1)
    return -log_p.gather(1, positive.unsqueeze(1)).mean()
