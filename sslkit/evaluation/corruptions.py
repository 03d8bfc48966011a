"""Image corruptions at set severities, Hendrycks and Dietterich's ImageNet-C / CIFAR-10-C definitions, made
deterministic: Gaussian noise, Gaussian blur, contrast, JPEG."""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["CORRUPTIONS", "SEVERITY_TABLES", "corrupt", "gaussian_kernel", "table_for"]

#: The parameter of each corruption at severities 1 to 5. ``imagenet``: ImageNet-C (Hendrycks and Dietterich,
#: ICLR 2019; ``hendrycks/robustness`` ``ImageNet-C/create_c/make_imagenet_c.py``, also ``imagecorruptions``);
#: ``cifar``: the same functions with CIFAR-10-C's parameters for 32-pixel images (``make_cifar_c.py``).
SEVERITY_TABLES: dict[str, dict[str, tuple[float, ...]]] = {
    "imagenet": {"gaussian_noise": (0.08, 0.12, 0.18, 0.26, 0.38), "gaussian_blur": (1, 2, 3, 4, 6),
                 "contrast": (0.4, 0.3, 0.2, 0.1, 0.05), "jpeg": (25, 18, 15, 10, 7)},
    "cifar": {"gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10), "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1.0),
              "contrast": (0.75, 0.5, 0.4, 0.3, 0.15), "jpeg": (80, 65, 58, 50, 40)},
}
CORRUPTIONS = ("gaussian_noise", "gaussian_blur", "contrast", "jpeg")


def table_for(name: str, image_size: int) -> str:
    """``auto``: CIFAR-10-C's parameters for images of 64 px or less (ImageNet-C's blur of sigma 6 leaves nothing of a
    28-pixel garment), ImageNet-C's above; else ``name`` itself."""
    if name == "auto":
        return "cifar" if image_size <= 64 else "imagenet"
    if name not in SEVERITY_TABLES:
        raise ValueError(f"unknown corruption table {name!r}: use auto, imagenet or cifar")
    return name


def gaussian_kernel(sigma: float, truncate: float = 4.0) -> Tensor:
    """scipy.ndimage's (and so skimage's ``gaussian``) 1-d kernel: radius ``int(truncate x sigma + 0.5)``, weights
    ``exp(-x^2 / (2 sigma^2))`` normalised to sum 1, float64."""
    radius = int(truncate * float(sigma) + 0.5)
    x = torch.arange(-radius, radius + 1, dtype=torch.float64)
    w = torch.exp(-0.5 * (x / float(sigma)) ** 2)
    return w / w.sum()


def _blur(x: Tensor, sigma: float) -> Tensor:
    """``skimage.filters.gaussian(x, sigma, channel_axis=...)``: each channel separately, edges by ``nearest``
    (the edge pixel repeated), in float64."""
    k = gaussian_kernel(sigma)
    r = (k.numel() - 1) // 2
    c = x.shape[0]
    y = x[None]
    y = F.conv2d(F.pad(y, (r, r, 0, 0), mode="replicate"), k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    y = F.conv2d(F.pad(y, (0, 0, r, r), mode="replicate"), k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)
    return y[0]


def _jpeg(image: Tensor, quality: int) -> Tensor:
    """PIL's JPEG at ``quality`` and back; a gray image goes through RGB and back to L, as ImageNet-C's does."""
    from PIL import Image

    arr = image.permute(1, 2, 0).numpy()
    gray = arr.shape[2] == 1
    pil = Image.fromarray(arr[:, :, 0], "L").convert("RGB") if gray else Image.fromarray(arr, "RGB")
    buf = io.BytesIO()
    pil.save(buf, "JPEG", quality=int(quality))
    buf.seek(0)
    with Image.open(buf) as out:
        back = np.asarray(out.convert("L") if gray else out.convert("RGB"))
    back = back[:, :, None] if back.ndim == 2 else back
    return torch.from_numpy(back.copy()).permute(2, 0, 1).contiguous()


def corrupt(image: Tensor, kind: str, severity: int, table: str = "imagenet", seed: int = 0) -> Tensor:
    """``image`` (uint8 ``[C, H, W]``, C 1 or 3) under corruption ``kind`` at ``severity`` (1 to 5), uint8:

    * ``gaussian_noise``: ``clip(x + N(0, c^2), 0, 1)``, the noise drawn from a generator seeded by ``seed`` (give
      each image its own, e.g. its index: the same image is corrupted the same way on every call);
    * ``gaussian_blur``: a Gaussian of standard deviation ``c`` pixels per channel (skimage's ``gaussian``: radius
      ``4c``, edges repeated);
    * ``contrast``: ``clip((x - m) c + m, 0, 1)``, ``m`` each channel's mean over the image;
    * ``jpeg``: saved by PIL at quality ``c`` and decoded.

    ``x`` is the image in [0, 1]; the result is ``x x 255`` cut to an integer as ``np.uint8`` does (the references
    return floats that their callers store as ``np.uint8``). ``c`` is :data:`SEVERITY_TABLES` ``[table][kind]``."""
    if kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {kind!r}: use one of {', '.join(CORRUPTIONS)}")
    if not 1 <= severity <= 5:
        raise ValueError(f"severity must be 1 to 5, got {severity}")
    if image.dtype != torch.uint8 or image.ndim != 3:
        raise ValueError("corrupt takes a uint8 [C, H, W] image")
    c = SEVERITY_TABLES[table][kind][severity - 1]
    if kind == "jpeg":
        return _jpeg(image, int(c))
    x = image.to(torch.float64) / 255.0
    if kind == "gaussian_noise":
        g = torch.Generator().manual_seed(int(seed))
        y = (x + torch.randn(x.shape, generator=g, dtype=torch.float64) * c).clamp(0, 1)
    elif kind == "gaussian_blur":
        y = _blur(x, float(c)).clamp(0, 1)
    else:
        m = x.mean(dim=(1, 2), keepdim=True)
        y = ((x - m) * c + m).clamp(0, 1)
    return (y * 255).to(torch.uint8)
