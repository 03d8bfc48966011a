"""The cross entropy of contrastive logits, written so that it is deterministic and sync-free on CUDA."""

from __future__ import annotations

import torch

__all__ = ["cross_entropy_at"]


def cross_entropy_at(logits: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``-log softmax(logits[i])[positive[i]]``: ``F.cross_entropy(logits, positive)``.

    Written as ``logsumexp(logits[i]) - logits[i, positive[i]]`` (the positive logit read with
    ``gather``) rather than through ``F.cross_entropy``: PyTorch documents ``NLLLoss`` on CUDA as
    an operation that raises under ``torch.use_deterministic_algorithms(True)``
    (``machine.deterministic=true``), while ``logsumexp`` and ``gather`` have deterministic CUDA
    kernels. Same value up to float rounding; no host-device sync. ``logits`` [N, C] (any float
    dtype; computed in float32), ``positive`` [N] int64 column indices on the same device.
    """
    logits = logits.float()
    pos = logits.gather(1, positive.unsqueeze(1)).squeeze(1)
    return (torch.logsumexp(logits, dim=1) - pos).mean()
