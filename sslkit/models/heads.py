"""Heads: the MLP projector / predictor used by SimCLR, MoCo, BYOL, SimSiam and friends."""

from __future__ import annotations

import torch
from torch import nn

from sslkit.registry import register_head

__all__ = ["MLPHead", "build_mlp", "build_no_head"]


class MLPHead(nn.Module):
    """``num_layers`` linear layers; all but the last followed by BatchNorm (optional) and ReLU.

    SimCLR's projector is ``MLPHead(d, 2048, 128, num_layers=2)``; ``last_bn`` adds an affine-free
    BatchNorm after the last layer (SimCLR v2, MoCo v3, SimSiam).
    """

    def __init__(
        self,
        in_dim: int,
        hidden_dim: int = 2048,
        out_dim: int = 128,
        num_layers: int = 2,
        batch_norm: bool = True,
        last_bn: bool = False,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"MLPHead needs num_layers >= 1, got {num_layers}")
        layers: list[nn.Module] = []
        dim = in_dim
        for _ in range(num_layers - 1):
            layers.append(nn.Linear(dim, hidden_dim, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm1d(hidden_dim))
            layers.append(nn.ReLU(inplace=True))
            dim = hidden_dim
        layers.append(nn.Linear(dim, out_dim, bias=not last_bn))
        if last_bn:
            layers.append(nn.BatchNorm1d(out_dim, affine=False))
        self.net = nn.Sequential(*layers)
        self.out_dim = out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project features [B, in_dim] to [B, out_dim]."""
        return self.net(x)


@register_head("mlp")
def build_mlp(
    in_dim: int,
    hidden_dim: int = 2048,
    out_dim: int = 128,
    num_layers: int = 2,
    batch_norm: bool = True,
    last_bn: bool = False,
) -> MLPHead:
    """An :class:`MLPHead`."""
    return MLPHead(in_dim, hidden_dim, out_dim, num_layers, batch_norm, last_bn)


@register_head("none")
def build_no_head(in_dim: int, hidden_dim: None = None, out_dim: None = None, num_layers: None = None) -> nn.Module:
    """No projector (MAE): the trunk's features pass through (``nn.Identity`` with ``out_dim = in_dim``). The MLP
    keys of the defaults must be null (``model.head={name: none, hidden_dim: null, out_dim: null, num_layers:
    null}``): a value for them would be ignored silently otherwise."""
    head = nn.Identity()
    head.out_dim = in_dim  # type: ignore[assignment]
    return head
