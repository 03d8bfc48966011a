"""SimCLR (Chen et al., 2020): two augmented views, an MLP projector and the NT-Xent loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sslkit.clock import StepContext
from sslkit.distributed import gather_with_grad, get_rank
from sslkit.methods.base import Method, register_method
from sslkit.methods.infonce import cross_entropy_at
from sslkit.registry import register_loss

__all__ = ["SIMCLR", "NTXentLoss", "nt_xent"]


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float = 0.1, gather: bool = True) -> torch.Tensor:
    """Normalised temperature-scaled cross entropy (SimCLR, eq. 1), averaged over the 2N anchors.

    For anchor ``i`` with positive ``p(i)`` (the other view of the same image) and
    ``s(u, v) = u.v / (|u||v|)``::

        l_i = -log( exp(s(z_i, z_p(i)) / T) / sum_{k != i} exp(s(z_i, z_k) / T) )

    where ``k`` runs over both views of every image in the global batch. With ``gather`` and a
    process group, the candidates are gathered from every rank with a gather that carries the
    gradient, so N ranks with batch B give the same loss and gradients as one with batch N*B.
    """
    b = z1.shape[0]
    z1 = F.normalize(z1.float(), dim=1)
    z2 = F.normalize(z2.float(), dim=1)
    if gather:
        all1, all2 = gather_with_grad(z1), gather_with_grad(z2)
    else:
        all1, all2 = z1, z2
    n = all1.shape[0]
    offset = get_rank() * b if n != b else 0
    anchors = torch.cat([z1, z2])  # [2b, d]
    candidates = torch.cat([all1, all2])  # [2n, d]
    logits = anchors @ candidates.T / temperature  # [2b, 2n]
    idx = torch.arange(b, device=z1.device) + offset
    self_cols = torch.cat([idx, idx + n])
    # Each anchor's own column is excluded with a mask built on the device: an indexed assignment of a
    # Python number (logits[rows, cols] = -inf) copies that number to the GPU and waits for the stream.
    own = torch.arange(2 * n, device=z1.device) == self_cols[:, None]
    logits = logits.masked_fill(own, float("-inf"))
    return cross_entropy_at(logits, torch.cat([idx + n, idx]))


@register_loss("nt_xent")
class NTXentLoss(nn.Module):
    """NT-Xent on the first two views' projections. Config: ``loss: {name: nt_xent, temperature}``.

    ``temperature`` 0.1 is the paper's ImageNet value with large batches; 0.5 suits batches of a
    few hundred (the paper's CIFAR-10 setting).
    """

    def __init__(self, temperature: float = 0.1, gather: bool = True) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"nt_xent temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.gather = gather

    def forward(self, output: dict[str, Any], sample: dict[str, Any], ctx: StepContext | None = None) -> torch.Tensor:
        """Loss of ``output["projections"][0]`` against ``output["projections"][1]``."""
        proj = output["projections"]
        if len(proj) < 2:
            raise ValueError(f"nt_xent needs two views per sample, got {len(proj)}")
        return nt_xent(proj[0], proj[1], self.temperature, self.gather)


#: The method object: what ``method.name=simclr`` trains.
SIMCLR = register_method(Method(
    name="simclr", model="ssl_model", loss="nt_xent", required_hooks=(), transform="simclr",
    summary=("SimCLR (Chen et al., 2020): two views, an MLP projector, NT-Xent against the other samples of"
             " the global batch."),
))
