"""Barlow Twins (Zbontar et al., 2021): push the cross-correlation of two views' embeddings to the identity."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sslkit.clock import StepContext
from sslkit.distributed import gather_with_grad
from sslkit.methods.base import Method, register_method
from sslkit.registry import register_loss

__all__ = ["BARLOW_TWINS", "BarlowTwinsLoss", "barlow_twins_loss", "cross_correlation", "standardise"]

# The model is the plain "ssl_model" (trunk + MLP projector, sslkit/models/ssl_model.py): the
# paper's projector is three linear layers of 8192 units, BatchNorm + ReLU after the first two,
# which is ``model.head: {name: mlp, num_layers: 3, hidden_dim: 8192, out_dim: 8192}``. The
# normalisation of the embeddings along the batch (the paper's affine-free BatchNorm ``self.bn``)
# is done by the loss, with statistics of the global batch.


def standardise(z: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Centre and scale every column of ``z`` [N, d] over the batch: ``(z - mean) / sqrt(var + eps)``.

    ``var`` is the biased (1/N) variance, as BatchNorm1d in training mode computes it (the
    reference code normalises with ``nn.BatchNorm1d(d, affine=False)``, eps 1e-5), so that the
    diagonal of ``z_n.T @ z_n / N`` is ``var / (var + eps)``, i.e. 1 up to ``eps``.
    """
    mean = z.mean(dim=0, keepdim=True)
    centred = z - mean
    var = centred.pow(2).mean(dim=0, keepdim=True)
    return centred * torch.rsqrt(var + eps)


def cross_correlation(z1: torch.Tensor, z2: torch.Tensor, eps: float = 1e-5, gather: bool = True) -> torch.Tensor:
    """Empirical cross-correlation ``C`` [d, d] of two views' embeddings (Barlow Twins, eq. 2)::

        C_ij = sum_b z1n_bi * z2n_bj / N,   z_n = standardise(z) along the batch

    ``N`` and the statistics of :func:`standardise` are those of the global batch: with
    ``gather`` and a process group, the embeddings of every rank are gathered with a gather
    that carries the gradient, so ``C`` (and the loss, and the gradients) on W ranks with
    batch B equal those of one process with batch W*B. With one process nothing is gathered.

    Computed in float32 with autocast off: ``C_ii`` is compared with 1, and a bf16 matmul over
    the batch would leave an error of ~1e-2 in every entry.
    """
    with torch.autocast(device_type=z1.device.type, enabled=False):
        z1, z2 = z1.float(), z2.float()
        if gather:
            z1, z2 = gather_with_grad(z1), gather_with_grad(z2)
        if z1.shape != z2.shape:
            raise ValueError(f"barlow_twins: views have different shapes {tuple(z1.shape)} and {tuple(z2.shape)}")
        n = z1.shape[0]
        if n < 2:
            raise ValueError(f"barlow_twins needs a (global) batch of at least 2 to standardise, got {n}")
        return standardise(z1, eps).T @ standardise(z2, eps) / n


def _on_off(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_i (1 - C_ii)^2`` and ``sum_{i != j} C_ij^2``."""
    diag = torch.diagonal(c)
    on = (1 - diag).pow(2).sum()
    off = c.pow(2).sum() - diag.pow(2).sum()
    return on, off


def barlow_twins_loss(
    z1: torch.Tensor, z2: torch.Tensor, lambd: float = 0.0051, eps: float = 1e-5, gather: bool = True
) -> torch.Tensor:
    """Barlow Twins loss (Zbontar et al., 2021, eq. 1) of two views' embeddings ``z1``, ``z2`` [N, d]::

        L = sum_i (1 - C_ii)^2 + lambd * sum_i sum_{j != i} C_ij^2

    with ``C`` the cross-correlation of :func:`cross_correlation` (global batch). The first term
    (invariance) makes each dimension agree across the views, the second (redundancy
    reduction) decorrelates the dimensions. ``lambd`` = 0.0051 is the paper's value for
    d = 8192. ``L`` is symmetric in the views (swapping them transposes ``C``) and invariant to
    a permutation of the batch. No loss scale (see :class:`BarlowTwinsLoss`).
    """
    on, off = _on_off(cross_correlation(z1, z2, eps, gather))
    return on + lambd * off


@register_loss("barlow_twins")
class BarlowTwinsLoss(nn.Module):
    """Barlow Twins loss on the first two views' projections.

    Config: ``loss: {name: barlow_twins, lambd: 0.0051, scale_loss: 1.0, eps: 1e-5, gather: true}``.

    Returns ``{"loss": scale_loss * (on + lambd * off), "on_diagonal": on, "off_diagonal": off}``
    (the two sums unscaled and detached, for the logs).

    ``scale_loss`` multiplies the loss. The published paper and the final reference code have
    none (1.0, the default); an earlier release of the reference code multiplied the loss by
    ``--scale-loss 0.024`` and used one learning rate (0.2) for every parameter. Under LARS the
    two set-ups are the same: with a loss scale ``s``, the weights' trust-ratio step is unchanged
    if the weight decay is divided by ``s`` (``s*g + wd*p`` points like ``g + (wd/s)*p``), while
    the biases and norm weights, which LARS leaves as plain SGD, move with ``lr * s``. So
    ``scale_loss: 0.024`` with ``weight_decay: wd * 0.024`` reproduces the final code's separate
    rates (0.2 for weights, 0.0048 = 0.2 * 0.024 for biases and BatchNorm) with sslkit's single
    learning rate.
    """

    def __init__(self, lambd: float = 0.0051, scale_loss: float = 1.0, eps: float = 1e-5, gather: bool = True) -> None:
        super().__init__()
        if lambd < 0:
            raise ValueError(f"barlow_twins lambd must be >= 0, got {lambd}")
        if scale_loss <= 0:
            raise ValueError(f"barlow_twins scale_loss must be > 0, got {scale_loss}")
        if eps < 0:
            raise ValueError(f"barlow_twins eps must be >= 0, got {eps}")
        self.lambd = lambd
        self.scale_loss = scale_loss
        self.eps = eps
        self.gather = gather

    def forward(self, output: dict[str, Any], sample: dict[str, Any],
                ctx: StepContext | None = None) -> dict[str, torch.Tensor]:
        """Loss of ``output["projections"][0]`` against ``output["projections"][1]``."""
        proj = output["projections"]
        if len(proj) < 2:
            raise ValueError(f"barlow_twins needs two views per sample, got {len(proj)}")
        on, off = _on_off(cross_correlation(proj[0], proj[1], self.eps, self.gather))
        loss = on + self.lambd * off
        if self.scale_loss != 1.0:
            loss = loss * self.scale_loss
        return {"loss": loss, "on_diagonal": on.detach(), "off_diagonal": off.detach()}

    def extra_repr(self) -> str:
        return f"lambd={self.lambd}, scale_loss={self.scale_loss}, eps={self.eps}, gather={self.gather}"


#: The method object: what ``method.name=barlow_twins`` trains.
BARLOW_TWINS = register_method(Method(
    name="barlow_twins", model="ssl_model", loss="barlow_twins", required_hooks=(), transform="simclr",
    summary="Barlow Twins (Zbontar et al., 2021): the cross-correlation of two views pushed to the identity.",
))
