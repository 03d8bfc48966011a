"""VICReg (Bardes et al., 2022): variance-invariance-covariance regularisation of two views' embeddings."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sslkit.clock import StepContext
from sslkit.distributed import gather_with_grad
from sslkit.methods.base import Method, register_method
from sslkit.registry import register_loss

__all__ = ["VICREG", "VICRegLoss", "covariance_term", "variance_term", "vicreg_loss"]

# The model is the plain "ssl_model" (trunk + MLP "expander", sslkit/models/ssl_model.py): the
# paper's expander is three linear layers of 8192 units, BatchNorm + ReLU after the first two,
# i.e. ``model.head: {name: mlp, num_layers: 3, hidden_dim: 8192, out_dim: 8192}``.


def variance_term(z: torch.Tensor, eps: float = 1e-4, target: float = 1.0) -> torch.Tensor:
    """Hinge on the standard deviation of each dimension of ``z`` [N, d] (VICReg, eq. 1)::

        v(Z) = 1/d sum_j max(0, target - sqrt(Var(z_j) + eps))

    ``Var`` is the unbiased (1/(N-1)) variance over the batch, as in the reference code.
    """
    std = torch.sqrt(z.var(dim=0) + eps)
    return F.relu(target - std).mean()


def covariance_term(z: torch.Tensor) -> torch.Tensor:
    """Sum of the squared off-diagonal entries of the covariance of ``z`` [N, d], over d (eq. 3-4)::

        C(Z) = 1/(N-1) sum_b (z_b - mean)(z_b - mean)^T,    c(Z) = 1/d sum_{i != j} C(Z)_ij^2
    """
    n, d = z.shape
    centred = z - z.mean(dim=0, keepdim=True)
    cov = centred.T @ centred / (n - 1)
    return (cov.pow(2).sum() - torch.diagonal(cov).pow(2).sum()) / d


def vicreg_loss(
    z1: torch.Tensor,
    z2: torch.Tensor,
    sim_coeff: float = 25.0,
    std_coeff: float = 25.0,
    cov_coeff: float = 1.0,
    eps: float = 1e-4,
    gather: bool = True,
) -> dict[str, torch.Tensor]:
    """VICReg loss (Bardes et al., 2022, eq. 6) of two views' embeddings ``z1``, ``z2`` [N, d]::

        s(Z, Z')  = 1/(N d) sum_b |z_b - z'_b|^2                       (invariance, MSE)
        v         = (v(Z) + v(Z')) / 2                                 (variance, see variance_term)
        c         = c(Z) + c(Z')                                       (covariance, see covariance_term)
        loss      = sim_coeff * s + std_coeff * v + cov_coeff * c      (25, 25, 1 in the paper)

    Returns ``{"loss", "invariance", "variance", "covariance"}``; the three terms are unweighted
    and detached (for the logs), ``loss`` carries the gradient.

    The invariance is the mean over this rank's pairs; with data parallelism the averaged
    gradients make it the mean over the global batch. Variance and covariance are statistics
    of the batch: with ``gather`` and a process group they use the embeddings of every rank,
    gathered with a gather that carries the gradient (the reference code's ``FullGatherLayer``),
    so W ranks of batch B give the values and gradients of one process with batch W*B. With one
    process nothing is gathered. Computed in float32 with autocast off.
    """
    with torch.autocast(device_type=z1.device.type, enabled=False):
        z1, z2 = z1.float(), z2.float()
        if z1.shape != z2.shape:
            raise ValueError(f"vicreg: views have different shapes {tuple(z1.shape)} and {tuple(z2.shape)}")
        invariance = F.mse_loss(z1, z2)
        if gather:
            z1, z2 = gather_with_grad(z1), gather_with_grad(z2)
        if z1.shape[0] < 2:
            raise ValueError(f"vicreg needs a (global) batch of at least 2 for its variance, got {z1.shape[0]}")
        variance = (variance_term(z1, eps) + variance_term(z2, eps)) / 2
        covariance = covariance_term(z1) + covariance_term(z2)
        loss = sim_coeff * invariance + std_coeff * variance + cov_coeff * covariance
    return {
        "loss": loss,
        "invariance": invariance.detach(),
        "variance": variance.detach(),
        "covariance": covariance.detach(),
    }


@register_loss("vicreg")
class VICRegLoss(nn.Module):
    """VICReg loss on the first two views' projections (the "expander" outputs).

    Config: ``loss: {name: vicreg, sim_coeff: 25.0, std_coeff: 25.0, cov_coeff: 1.0, eps: 1e-4,
    gather: true}`` (the paper's values are the defaults). Returns the dict of :func:`vicreg_loss`,
    so ``invariance``, ``variance`` and ``covariance`` are logged next to the loss.
    """

    def __init__(
        self,
        sim_coeff: float = 25.0,
        std_coeff: float = 25.0,
        cov_coeff: float = 1.0,
        eps: float = 1e-4,
        gather: bool = True,
    ) -> None:
        super().__init__()
        for key, value in (("sim_coeff", sim_coeff), ("std_coeff", std_coeff), ("cov_coeff", cov_coeff)):
            if value < 0:
                raise ValueError(f"vicreg {key} must be >= 0, got {value}")
        if eps <= 0:
            raise ValueError(f"vicreg eps must be > 0 (it keeps sqrt differentiable at 0), got {eps}")
        self.sim_coeff = sim_coeff
        self.std_coeff = std_coeff
        self.cov_coeff = cov_coeff
        self.eps = eps
        self.gather = gather

    def forward(self, output: dict[str, Any], sample: dict[str, Any],
                ctx: StepContext | None = None) -> dict[str, torch.Tensor]:
        """Loss of ``output["projections"][0]`` against ``output["projections"][1]``."""
        proj = output["projections"]
        if len(proj) < 2:
            raise ValueError(f"vicreg needs two views per sample, got {len(proj)}")
        return vicreg_loss(proj[0], proj[1], self.sim_coeff, self.std_coeff, self.cov_coeff, self.eps, self.gather)

    def extra_repr(self) -> str:
        return (f"sim_coeff={self.sim_coeff}, std_coeff={self.std_coeff}, cov_coeff={self.cov_coeff}, "
                f"eps={self.eps}, gather={self.gather}")


#: The method object: what ``method.name=vicreg`` trains.
VICREG = register_method(Method(
    name="vicreg", model="ssl_model", loss="vicreg", required_hooks=(), transform="simclr",
    summary="VICReg (Bardes et al., 2022): invariance, variance and covariance terms on two views.",
))
