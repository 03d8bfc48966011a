"""DINOv2's and iBOT's loss pieces: KoLeo, the masked patches' slots, the masked-patch cross-entropy (Sinkhorn-Knopp:
methods/sinkhorn.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from sslkit.distributed import gather_with_grad

__all__ = ["gather_slots", "koleo_loss", "masked_patch_loss", "masked_slots"]


def koleo_loss(x: torch.Tensor, eps: float = 1e-8, gather: bool = True,
               return_distance: bool = False) -> Any:
    r"""The Kozachenko-Leonenko entropy estimator's loss (Sablayrolles et al. 2019; DINOv2, Oquab et al. 2024,
    section 4; ``dinov2/loss/koleo_loss.py``) on ``x`` ``[B, D]``:

    .. math::

        z_i = x_i / \lVert x_i \rVert, \qquad \rho_i = \min_{j \neq i} \lVert z_i - z_j + \epsilon \rVert, \qquad
        L = -\frac{1}{B} \sum_i \log(\rho_i + \epsilon)

    the nearest neighbour found by the largest dot product (as DINOv2), the distance that of
    ``torch.pairwise_distance`` (which adds ``eps`` to the difference). With ``gather`` (and a process group)
    the neighbours come from the *global* batch (every rank's ``x``, gathered with its gradient) and the mean
    is over it, so N processes compute what one process does on the N-fold batch; DINOv2 computes it on each
    rank's batch (``gather=False``). Two identical rows make ``rho = eps * sqrt(D)`` (the added ``eps`` in
    each of the D coordinates), so each contributes ``-log(eps * (sqrt(D) + 1))`` to the sum: 16.5 at D = 32,
    15.4 at D = 384 with the default ``eps``, the duplicate-images failure sslkit warns about
    (:mod:`sslkit.stability`). With ``return_distance`` also the smallest nearest-neighbour distance of the batch
    (detached): ``(loss, min rho)``. Computed in float32.
    """
    x = F.normalize(x.float(), dim=-1, eps=eps)
    if gather:
        x = gather_with_grad(x)
    n = x.shape[0]
    with torch.no_grad():
        dots = x @ x.T
        dots.fill_diagonal_(-2.0)  # below any cosine: never one's own neighbour
        nearest = dots.argmax(dim=1)
    # the neighbours as a one-hot product rather than x[nearest]: the same values, and a backward that is a matrix
    # product (a fixed order of additions) instead of index_put_'s accumulation, whose atomic adds on the CPU make
    # two identical runs differ (several rows share a nearest neighbour); x @ x.T above costs as much
    neighbours = F.one_hot(nearest, n).to(x.dtype) @ x
    rho = F.pairwise_distance(x, neighbours, p=2, eps=eps)
    if return_distance:
        return -torch.log(rho + eps).sum() / n, rho.detach().min()
    return -torch.log(rho + eps).sum() / n


@torch.no_grad()
def masked_slots(mask: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's masked patches in ``slots`` fixed places: ``mask`` ``[B, N]`` (True where masked) -> ``(index
    [B, slots], weight [B, slots])``, the masked patches first (raster order), the remaining slots filled with
    unmasked patches of weight 0 (:func:`gather_slots` takes the tokens there). ``slots`` must be at least the most
    patches a mask can hide (:meth:`sslkit.models.masking.BlockMasking.max_masked`): a fixed shape, no boolean
    indexing, no
    host sync (DINOv2 gathers the masked tokens of the batch with an index its host-side collate built). A whole
    batch in one buffer: ``mask.reshape(1, -1)`` and ``slots`` from :func:`sslkit.models.masking.batch_slots`; past them
    the last masked patches have no place and are left out."""
    index = torch.argsort((~mask).to(torch.int32), dim=1, stable=True)[:, :slots]
    return index, mask.gather(1, index).float()


def gather_slots(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tokens`` ``[B, N, D]`` at the places ``index`` ``[B, M]`` of :func:`masked_slots`: ``[B, M, D]``."""
    return tokens.gather(1, index[..., None].expand(-1, -1, tokens.shape[-1]))


def masked_patch_loss(student: torch.Tensor, teacher_probs: torch.Tensor, weight: torch.Tensor,
                      student_temp: float = 0.1, image: torch.Tensor | None = None,
                      images: int | None = None) -> torch.Tensor:
    r"""iBOT's masked image modelling loss (Zhou et al. 2022, eq. 2; ``ibot/main_ibot.py`` ``iBOTLoss``; DINOv2's
    ``iBOTPatchLoss.forward_masked``) for one view:

    .. math::

        \ell_{bn} = -\sum_k P_t[b, n, k] \log \mathrm{softmax}(s[b, n] / \tau_s)_k, \qquad
        L = \frac{1}{B} \sum_b \frac{\sum_n w_{bn} \ell_{bn}}{\max(1, \sum_n w_{bn})}

    ``student`` ``[B, M, K]`` logits, ``teacher_probs`` ``[B, M, K]`` (centred and sharpened, or Sinkhorn-Knopp),
    ``weight`` ``[B, M]`` 1 on the masked patches: each image's loss is the mean over its masked patches, the
    batch's the mean over *all* its images (an unmasked image adds 0, as in both reference codes). Float32.

    With ``image`` ``[S]`` the slots are a whole batch's in one buffer (:func:`sslkit.models.masking.batch_slots`):
    ``student`` and ``teacher_probs`` ``[S, K]``, ``weight`` ``[S]``, ``image`` the image of each slot among
    ``images``; the same loss, each image's sums taken by a one-hot product (a fixed order of additions: no
    atomic adds, deterministic on CUDA).
    """
    log_p = F.log_softmax(student.float() / student_temp, dim=-1)
    per_patch = -(teacher_probs.float() * log_p).sum(dim=-1)  # [B, M] or [S]
    w = weight.float()
    if image is None:
        return ((per_patch * w).sum(dim=1) / w.sum(dim=1).clamp(min=1.0)).mean()
    if images is None:
        raise ValueError("masked_patch_loss: slots given with their image need the number of images")
    owner = (image[None, :] == torch.arange(images, device=image.device)[:, None]).to(w.dtype)  # [B, S]
    return ((owner @ (per_patch * w)) / (owner @ w).clamp(min=1.0)).mean()
