"""DINOv3's Gram anchoring, as tensor-in parts: the Gram loss, the tokens it reads, the Gram teacher's patch grid
resized to the student's, and the updates at which the Gram teacher is a fresh snapshot of the EMA teacher.

Siméoni et al. 2025 ("DINOv3"), section 4: the student's patch features keep the patch-to-patch similarity
structure (the Gram matrix of the L2-normalised patch features) of an earlier teacher, which stops the dense
features from degrading over long training. The reference is ``dinov3/loss/gram_loss.py`` and the ``gram`` parts
of ``dinov3/train/ssl_meta_arch.py`` and ``train.py`` (facebookresearch/dinov3); every option there is here, the
token selection done with weights instead of boolean indexing (a fixed shape, no host sync). The DINOv3 method
(``methods/dinov3.py``, with its GramTeacherHook) composes these with the DINOv2 parts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["GRAM_NEGATIVES", "GRAM_TOKENS", "gram_loss", "gram_matrix", "gram_snapshot_at", "gram_token_weights",
           "resize_patch_grid"]

#: Which patch tokens enter the Gram loss (``gram.tokens_used`` of the reference): every patch of the global crops,
#: only the masked ones (the student saw mask tokens there) or only the visible ones.
GRAM_TOKENS = ("all", "masked", "unmasked")
#: What happens to negative similarities: kept; set to 0 in both Gram matrices (``remove_neg``); set to 0 in the
#: teacher's only (``remove_only_teacher_neg`` as DINOv3's code runs it); set to 0 in the teacher's, and in the
#: student's where both are negative (the same option as its comment reads it, dinov3 pull request #265).
GRAM_NEGATIVES = ("keep", "both", "teacher", "shared")


def gram_matrix(patches: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """``patches @ patches^T`` over the last two dimensions (``[..., N, D] -> [..., N, N]``), in float32, of the
    L2-normalised rows with ``normalize`` (then the entries are cosine similarities)."""
    x = patches.float()
    if normalize:
        x = F.normalize(x, dim=-1)
    return x @ x.transpose(-1, -2)


def gram_loss(student: torch.Tensor, teacher: torch.Tensor, *, normalize: bool = True, image_level: bool = True,
              negatives: str = "keep", weights: torch.Tensor | None = None) -> torch.Tensor:
    r"""The mean squared difference between the student's and the teacher's Gram matrices.

    ``student`` and ``teacher`` are patch features ``[B, N, D]`` (the teacher's detached by the caller). With
    ``image_level`` each image has its own ``N x N`` Gram matrix and the mean is over ``B N^2`` entries; without,
    the ``B N`` patches of the local batch form one ``BN x BN`` matrix. ``weights`` ``[B, N]`` (0 or 1, from
    :func:`gram_token_weights`) keeps only some patches, in the batch-level form only (as the reference, whose
    selected patches lose their image): the mean is then over the selected pairs,

    .. math::

        L = \frac{\sum_{ij} w_i w_j (S_{ij} - T_{ij})^2}{(\sum_i w_i)^2}

    which is the reference's MSE over the selected rows. ``negatives`` (:data:`GRAM_NEGATIVES`) treats negative
    similarities:

    * ``both`` (``remove_neg``): ``S <- max(S, 0)``, ``T <- max(T, 0)``;
    * ``teacher`` (``remove_only_teacher_neg``, as ``dinov3/loss/gram_loss.py`` on DINOv3's main branch runs it):
      ``T <- max(T, 0)`` and ``S`` unchanged. The reference zeroes the teacher's negatives first and then the
      student's entries where ``S < 0`` and ``T < 0``, a condition the already-zeroed teacher never meets (dinov3
      pull requests #167 and #265; a maintainer there: the option is not used by Gram anchoring);
    * ``shared``: what the reference's comment and pull request #265 (not merged) intend: ``T <- max(T, 0)`` and
      ``S_ij <- 0`` where ``S_ij < 0`` and ``T_ij < 0`` (both read before either is changed).

    Computed in float32.
    """
    if negatives not in GRAM_NEGATIVES:
        raise ValueError(f"unknown gram negatives {negatives!r}: use one of {', '.join(GRAM_NEGATIVES)}")
    if student.shape != teacher.shape or student.dim() != 3:
        raise ValueError(f"the Gram loss compares patch features [B, N, D] of one shape, got {tuple(student.shape)} "
                         f"and {tuple(teacher.shape)}")
    if weights is not None and image_level:
        raise ValueError("a selection of tokens (gram.tokens_used masked or unmasked) needs the batch-level Gram "
                         "matrix (gram.img_level=false), as DINOv3's")
    if not image_level:
        student, teacher = student.flatten(0, 1)[None], teacher.flatten(0, 1)[None]
    s, t = gram_matrix(student, normalize), gram_matrix(teacher, normalize)
    if negatives == "both":
        s, t = s.clamp(min=0), t.clamp(min=0)
    elif negatives == "teacher":
        t = t.clamp(min=0)
    elif negatives == "shared":
        s = torch.where((s < 0) & (t < 0), torch.zeros_like(s), s)
        t = t.clamp(min=0)
    squared = (s - t).square()
    if weights is None:
        return squared.mean()
    w = weights.reshape(-1).to(squared.dtype)
    return (w @ squared[0] @ w) / w.sum().square().clamp(min=1.0)


def gram_token_weights(masks: torch.Tensor, tokens: str) -> torch.Tensor | None:
    """The weights ``[B, N]`` that select the patches :func:`gram_loss` reads: None for ``all``, the mask (True
    where the student saw a mask token) for ``masked``, its complement for ``unmasked``."""
    if tokens not in GRAM_TOKENS:
        raise ValueError(f"unknown gram tokens {tokens!r}: use one of {', '.join(GRAM_TOKENS)}")
    if tokens == "all":
        return None
    return (masks if tokens == "masked" else ~masks).float()


def resize_patch_grid(patches: torch.Tensor, grid: tuple[int, int], size: tuple[int, int], mode: str = "bicubic",
                      antialias: bool = False) -> torch.Tensor:
    """Patch features ``[B, h*w, D]`` on the ``grid`` ``(h, w)`` resampled to ``size`` ``(h', w')`` -> ``[B, h'*w',
    D]``: the high-resolution Gram teacher's patches brought to the student's grid, as DINOv3 does (``interpolate``
    of the ``[B, D, h, w]`` map, bicubic, ``align_corners=False``, no antialiasing by default)."""
    b, n, d = patches.shape
    if n != grid[0] * grid[1]:
        raise ValueError(f"{n} patches do not fill a {grid[0]} x {grid[1]} grid")
    if tuple(grid) == tuple(size):
        return patches
    maps = patches.transpose(1, 2).reshape(b, d, grid[0], grid[1])
    resized = F.interpolate(maps, size=size, mode=mode, align_corners=False if mode != "nearest" else None,
                            antialias=antialias)
    return resized.flatten(2).transpose(1, 2)


def gram_snapshot_at(update: int, start: int, every: int = 0, max_refreshes: int | None = None) -> bool:
    """True when the Gram teacher becomes a snapshot of the EMA teacher before ``update`` (0-based): at ``start``,
    the first update with the Gram loss, then every ``every`` updates (0: never again), at most ``max_refreshes``
    times after the first. DINOv3's ViT-7B Gram stage (``dinov3_vit7b16_gram_anchor.yaml``: ``it_first_update``
    1,010,000, ``update_frequency`` 10,000, ``max_steps`` 3, from a checkpoint at 1,000,000) is ``start``
    1,000,000, ``every`` 10,000, ``max_refreshes`` 3: snapshots before updates 1.01, 1.02 and 1.03 million."""
    if update < start:
        return False
    if update == start:
        return True
    if every <= 0 or (update - start) % every:
        return False
    return max_refreshes is None or (update - start) // every <= max_refreshes
