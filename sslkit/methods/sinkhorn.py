"""Sinkhorn-Knopp: the one equipartition of scores over prototypes, SwAV's codes and DINOv2's teacher targets."""

from __future__ import annotations

import torch

from sslkit.distributed import all_reduce_max, all_reduce_sum

__all__ = ["sinkhorn_knopp"]


def sinkhorn_knopp(logits: torch.Tensor, temperature: float, iterations: int = 3, weight: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    r"""Soft assignments ``[B, K]`` of the rows of ``logits`` ``[B, K]`` to ``K`` prototypes by Sinkhorn-Knopp (SwAV,
    Caron et al. 2020, section 3.1 and eq. 3; DINOv2's ``SinkhornKnoppTeacher``).

    Solves ``max_Q Tr(Q^T S) + temperature H(Q)`` over the transportation polytope where the prototypes share the
    *global* batch equally by alternate normalisation of ``P = exp(S / temperature)``::

        P <- P / sum(P)
        repeat `iterations` times:
            P <- P / (K * column sums)       # each prototype gets 1 / K of the mass
            P <- P / (B * row sums)          # each row gets 1 / B (B: the rows of every process)
        Q = B * P                            # each row sums to 1

    ``weight`` ``[B]`` (0 or 1) leaves rows out: padding slots of the masked patches (DINOv2 passes the number of
    real rows, ``n_masked_patches``); their rows come back 0 and ``B`` counts the others. Every sum over the batch
    is all-reduced (the total, the column sums and the row count), so N processes return the rows one process
    returns on the N-fold batch; with one process no collective runs. The global maximum of the real rows is
    subtracted before the exponential (the first normalisation cancels it), so ``exp`` cannot overflow; entries
    more than ~87 (float32) or ~700 (float64) temperatures below it underflow to 0.

    ``dtype``: the precision of the computation (SwAV's codes: float64, over cosine scores and a small
    ``epsilon``; DINOv2's targets: float32). Returns float32 probabilities without gradient.
    """
    if iterations < 1:
        raise ValueError(f"sinkhorn needs iterations >= 1, got {iterations}")
    if temperature <= 0:
        raise ValueError(f"sinkhorn needs a temperature (epsilon) > 0, got {temperature}")
    logits = logits.detach().to(dtype)
    k = logits.shape[1]
    if weight is None:
        weight = torch.ones_like(logits[:, 0])
    weight = weight.to(dtype)
    tiny = torch.finfo(dtype).tiny
    real = weight[:, None] > 0
    top = all_reduce_max(torch.where(real, logits, torch.full_like(logits, -torch.inf)).max())
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # no real row anywhere: all zeros below
    q = torch.where(real, torch.exp((logits - top) / temperature), torch.zeros_like(logits))  # [B, K]
    stats = all_reduce_sum(torch.stack([q.sum(), weight.sum()]))
    q = q / stats[0].clamp(min=tiny)
    batch = stats[1]
    for _ in range(iterations):
        q = q / all_reduce_sum(q.sum(dim=0, keepdim=True)).clamp(min=tiny) / k  # every prototype 1 / K of the mass
        q = q / q.sum(dim=1, keepdim=True).clamp(min=tiny) / batch.clamp(min=1.0)  # every row 1 / B
    return (q * batch).float()
