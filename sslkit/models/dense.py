"""Features per image location of any trunk (a ViT's patch tokens, a CNN's last feature map) beside its pooled ones."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from sslkit.models.tokens import TokenTrunk
from sslkit.models.trunks import grid_pool

__all__ = ["DenseFeatures", "TimmDense", "dense_features", "has_feature_map", "map_channels", "resize_bilinear"]


class DenseFeatures(NamedTuple):
    """One forward's features: ``pooled`` ``[B, out_dim]`` (what ``trunk(x)`` returns) and ``map`` ``[B, h, w, C]``
    (the features per location that the pooling read)."""

    pooled: torch.Tensor
    map: torch.Tensor


def has_feature_map(trunk: nn.Module) -> bool:
    """Whether :func:`dense_features` can read ``trunk``: a :class:`~sslkit.models.tokens.TokenTrunk`, a trunk with
    its own ``forward_dense(x) -> DenseFeatures``, a torchvision ResNet (its ``avgpool``) or sslkit's small CNN (its
    ``features`` convolutions)."""
    return (isinstance(trunk, TokenTrunk) or callable(getattr(trunk, "forward_dense", None))
            or isinstance(getattr(trunk, "avgpool", None), nn.Module)
            or (isinstance(getattr(trunk, "features", None), nn.Sequential) and hasattr(trunk, "pool_size")))


def map_channels(trunk: nn.Module) -> int:
    """The channels ``C`` of ``trunk``'s feature map: a ViT's token width, else ``trunk.map_channels`` when the trunk
    says it, else the output channels of its last convolution (a ResNet's ``out_dim``, the small CNN's ``8 width``)."""
    if isinstance(trunk, TokenTrunk):
        return int(trunk.out_dim)
    given = getattr(trunk, "map_channels", None)
    if isinstance(given, int):
        return given
    convs = [m for m in trunk.modules() if isinstance(m, nn.Conv2d)]
    if not convs:
        raise ValueError(f"{type(trunk).__name__} has no convolution and no map_channels: its feature map's width "
                         "is unknown")
    return int(convs[-1].out_channels)


def dense_features(trunk: nn.Module, x: torch.Tensor) -> DenseFeatures:
    """``trunk``'s pooled features and its feature map of ``x`` in one forward, with gradient:

    * a ViT (:class:`~sslkit.models.tokens.TokenTrunk`): its pooled tokens and its patch tokens after the final norm,
      on the patch grid;
    * a trunk with ``forward_dense`` (a user's): what that gives;
    * a torchvision ResNet: its output and the map that enters its ``avgpool`` (read by a forward pre-hook);
    * sslkit's small CNN: its convolutions' map, then its own grid pooling of that map.

    Raises ``ValueError`` for another trunk (:func:`has_feature_map` says beforehand)."""
    if isinstance(trunk, TokenTrunk):
        tokens = trunk.forward_tokens(x)
        h, w = tokens.grid
        return DenseFeatures(trunk.pool_tokens(tokens), tokens.patches.reshape(x.shape[0], h, w, -1))
    own = getattr(trunk, "forward_dense", None)
    if callable(own):
        return own(x)
    pool = getattr(trunk, "avgpool", None)
    if isinstance(pool, nn.Module):  # a torchvision ResNet: the map that enters its global pooling
        seen: dict[str, torch.Tensor] = {}
        handle = pool.register_forward_pre_hook(lambda _m, args: seen.__setitem__("map", args[0]))
        try:
            pooled = trunk(x)
        finally:
            handle.remove()
        return DenseFeatures(pooled, seen["map"].permute(0, 2, 3, 1))
    body = getattr(trunk, "features", None)
    if isinstance(body, nn.Sequential) and hasattr(trunk, "pool_size"):  # sslkit's small CNN
        fmap = body(x)
        return DenseFeatures(torch.flatten(grid_pool(fmap, int(trunk.pool_size)), 1), fmap.permute(0, 2, 3, 1))
    raise ValueError(f"{type(trunk).__name__} gives no features per location: a ViT's patch tokens, a torchvision "
                     "ResNet's or sslkit's small CNN's last feature map, or a trunk's own forward_dense(x)")


class TimmDense(nn.Module):
    """Any timm model as a trunk with a feature map: ``forward`` its pooled pre-logits features (``forward_head(...,
    pre_logits=True)``, ``out_dim = num_features``), ``forward_dense`` those and the map of ``forward_features``: a
    CNN's ``[B, C, h, w]`` or a ViT's tokens without its ``num_prefix_tokens`` (CLS, registers) on the patch grid."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.out_dim = int(model.num_features)
        self.map_channels = self.out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The pooled features ``[B, out_dim]``."""
        return self.forward_dense(x).pooled

    def forward_dense(self, x: torch.Tensor) -> DenseFeatures:
        """The pooled features and the map ``[B, h, w, C]``."""
        feats = self.model.forward_features(x)
        pooled = self.model.forward_head(feats, pre_logits=True)
        if feats.ndim == 4:
            return DenseFeatures(pooled, feats.permute(0, 2, 3, 1))
        patches = feats[:, int(getattr(self.model, "num_prefix_tokens", 0)):]
        n = patches.shape[1]
        h = round(n ** 0.5 * (x.shape[-2] / x.shape[-1]) ** 0.5)
        w = n // max(h, 1)
        if h * w != n:
            raise ValueError(f"{type(self.model).__name__} gave {n} patch tokens for a {x.shape[-2]} x {x.shape[-1]} "
                             "image: not a grid")
        return DenseFeatures(pooled, patches.reshape(x.shape[0], h, w, -1))


def _bilinear_matrix(size: int, out: int, like: torch.Tensor) -> torch.Tensor:
    """``[out, size]``: row ``i`` holds the bilinear weights ``F.interpolate(..., align_corners=False)`` gives output
    ``i``: the source coordinate ``(i + 0.5) size / out - 0.5`` (at least 0) between its two neighbours."""
    rows = torch.arange(out, device=like.device, dtype=torch.float64)
    src = ((rows + 0.5) * (size / out) - 0.5).clamp(min=0.0)
    low = src.floor().long().clamp(max=size - 1)
    high = (low + 1).clamp(max=size - 1)
    frac = src - low.to(torch.float64)
    weights = torch.zeros(out, size, device=like.device, dtype=torch.float64)
    weights.scatter_add_(1, low[:, None], (1.0 - frac)[:, None])
    weights.scatter_add_(1, high[:, None], frac[:, None])
    return weights.to(like.dtype)


def resize_bilinear(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``x`` ``[B, C, h, w]`` resized to ``size`` as ``F.interpolate(x, size, mode="bilinear", align_corners=False)``
    computes it, as two products with small weight matrices: ``upsample_bilinear2d``'s CUDA backward accumulates with
    atomics (PyTorch raises on it under ``torch.use_deterministic_algorithms``); a matrix product's backward does
    not. The input itself when it already has the size."""
    h, w = x.shape[-2:]
    if (h, w) == tuple(size):
        return x
    return torch.einsum("ph,nchw,qw->ncpq", _bilinear_matrix(h, size[0], x), x, _bilinear_matrix(w, size[1], x))
