"""Trunks (encoders): torchvision ResNets with an optional small-image stem, and a small CNN for CPU runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sslkit.registry import register_trunk

__all__ = ["SmallCNN", "build_resnet", "grid_pool"]


def _pool_matrix(size: int, out: int, like: torch.Tensor) -> torch.Tensor:
    """[out, size]: row i averages the input cells of adaptive-pooling window i (floor/ceil bounds)."""
    rows = torch.arange(out, device=like.device)
    start = (rows * size) // out
    end = -((-(rows + 1) * size) // out)  # ceil((i + 1) * size / out)
    cols = torch.arange(size, device=like.device)
    inside = (cols >= start[:, None]) & (cols < end[:, None])
    return inside.to(like.dtype) / (end - start).to(like.dtype)[:, None]


def grid_pool(x: torch.Tensor, size: int) -> torch.Tensor:
    """Average-pool ``x`` [B, C, H, W] to a ``size`` x ``size`` grid: what ``F.adaptive_avg_pool2d`` computes.

    ``adaptive_avg_pool2d``'s CUDA backward accumulates with atomics, and PyTorch raises on it under
    ``torch.use_deterministic_algorithms(True)`` (``machine.deterministic=true``). Here the grid is
    taken without it: the input itself when it already is the grid, ``avg_pool2d`` (deterministic
    backward) when the sides divide evenly, and otherwise the product with two small averaging
    matrices, ``P_h x P_w^T``, whose windows are adaptive pooling's (also when the grid is larger
    than the input, e.g. the 2x2 maps of 12-pixel local crops, which are replicated).
    """
    h, w = x.shape[-2:]
    if (h, w) == (size, size):
        return x
    if h % size == 0 and w % size == 0:
        return F.avg_pool2d(x, (h // size, w // size))
    return torch.einsum("ph,nchw,qw->ncpq", _pool_matrix(h, size, x), x, _pool_matrix(w, size, x))


class SmallCNN(nn.Module):
    """Four 3x3 conv-BN-ReLU blocks (the last three with stride 2), average-pooled to a
    ``pool_size`` x ``pool_size`` grid (:func:`grid_pool`: deterministic on CUDA too) and flattened.

    Sized for 28x28 to 64x64 images on a CPU: about 12 MFLOPs per 28x28 image at width 32.
    ``out_dim`` is ``8 * width * pool_size**2``. The grid keeps the coarse layout of the image,
    which global average pooling (``pool_size=1``) throws away: on Fashion-MNIST, whose classes
    differ in shape, the same SimCLR-trained weights give a kNN top-1 of 0.817 with global
    pooling and 0.850 with a 4x4 grid (docs/results.md).
    """

    def __init__(self, in_channels: int = 3, width: int = 32, pool_size: int = 4) -> None:
        super().__init__()
        chans = [in_channels, width, 2 * width, 4 * width, 8 * width]
        layers: list[nn.Module] = []
        for i in range(4):
            stride = 1 if i == 0 else 2
            layers += [
                nn.Conv2d(chans[i], chans[i + 1], 3, stride=stride, padding=1, bias=False),
                nn.BatchNorm2d(chans[i + 1]),
                nn.ReLU(inplace=True),
            ]
        self.features = nn.Sequential(*layers)
        self.pool_size = pool_size
        self.out_dim = chans[-1] * pool_size * pool_size
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images [B, C, H, W] to features [B, out_dim]."""
        return torch.flatten(grid_pool(self.features(x), self.pool_size), 1)


@register_trunk("small_cnn")
def build_small_cnn(in_channels: int = 3, width: int = 32, pool_size: int = 4) -> SmallCNN:
    """The small CNN of :class:`SmallCNN`."""
    return SmallCNN(in_channels=in_channels, width=width, pool_size=pool_size)


def build_resnet(
    depth: int, in_channels: int = 3, small_image_stem: bool = False, zero_init_residual: bool = True
) -> nn.Module:
    """A torchvision ResNet without its classifier; ``out_dim`` is the pooled feature size.

    ``small_image_stem`` swaps the 7x7/2 conv and max-pool for a 3x3/1 conv (the CIFAR stem of
    SimCLR and most SSL papers), for images of 32-96 pixels. Weights are random: SSL trains
    from scratch, and nothing is downloaded.
    """
    import torchvision  # (imported when a ResNet is built: about a second, with torch._dynamo through its ops)

    builders = {18: torchvision.models.resnet18, 34: torchvision.models.resnet34,
                50: torchvision.models.resnet50, 101: torchvision.models.resnet101}
    net = builders[depth](weights=None, zero_init_residual=zero_init_residual)
    if small_image_stem:
        net.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    if in_channels != 3 or small_image_stem:
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    net.out_dim = net.fc.in_features
    net.fc = nn.Identity()
    return net


@register_trunk("resnet18")
def build_resnet18(in_channels: int = 3, small_image_stem: bool = False, zero_init_residual: bool = True) -> nn.Module:
    """torchvision ResNet-18 trunk (512-d features)."""
    return build_resnet(18, in_channels, small_image_stem, zero_init_residual)


@register_trunk("resnet50")
def build_resnet50(in_channels: int = 3, small_image_stem: bool = False, zero_init_residual: bool = True) -> nn.Module:
    """torchvision ResNet-50 trunk (2048-d features)."""
    return build_resnet(50, in_channels, small_image_stem, zero_init_residual)
