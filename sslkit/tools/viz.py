"""``sslkit viz``: what an encoder learned, as pictures (attention maps, patch PCA, an embedding map, neighbours)."""

from __future__ import annotations

import html
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor, nn

from sslkit.files import atomic_write
from sslkit.models.dense import dense_features, has_feature_map
from sslkit.models.tokens import TokenTrunk
from sslkit.tools.pretrained import Pretrained, ToolError

__all__ = ["KINDS", "VIZ_KEYS", "cls_attention", "embed_2d", "foreground", "kept_by_mass", "nearest", "patch_features",
           "principal_components", "viz_main"]

logger = logging.getLogger("sslkit")

#: What ``kind=`` can name, in the order they are drawn.
KINDS = ("attention", "pca", "embedding", "neighbors")

VIZ_KEYS: dict[str, str] = {
    "checkpoint": "a run folder (its latest checkpoint) or a checkpoint file",
    "kind": "attention,pca,embedding,neighbors: a comma list (default: every kind the trunk has; attention needs a "
            "ViT)",
    "images": "a folder of images (class subfolders give labels), or a file list (a 'path' or 'path,label' a line); "
              "default: the run's evaluation split (split=)",
    "split": "test (default) | train: the evaluation split images come from without images=",
    "n": "images drawn by attention, pca and neighbors (default 8), spread evenly over the images",
    "samples": "embedding: samples mapped (default 2000, spread evenly over the split; 0: all)",
    "k": "neighbors: neighbours drawn per query (default 8)",
    "memory": "neighbors: training samples searched (default 0: the whole kNN memory, the run's eval train split)",
    "mass": "attention: the share of each head's attention its mask keeps (default 0.6, DINO's figures)",
    "method": "embedding: auto (UMAP with umap-learn installed, else PCA) | umap | pca",
    "features": "trunk (default) | teacher: the momentum encoder of BYOL, MoCo, DINO, iBOT, DINOv2, I-JEPA",
    "image_size": "the side the model sees images at (default: the run's eval transform; a ViT takes any multiple of "
                  "its patch size, e.g. 224 for sharper maps)",
    "output": "the folder (default <run>/viz); each kind goes into <output>/<kind>/",
}

#: Class names of the built-in labelled sources (a folder's come from its class folders).
CLASS_NAMES = {
    "fashion_mnist": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                      "Ankle boot"],
    "cifar10": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"],
}

#: Layout of the picture grids, in pixels: the gap between panels and the height of a caption line.
PAD = 4
LINE = 12
#: Panels are drawn at least this many pixels wide (small images are enlarged, by a whole factor, nearest).
MIN_CELL = 96
#: Rows of a grid PNG; more images go into further files.
ROWS_PER_FILE = 8


# ----------------------------------------------------------------------------------------------------
# The numbers behind the pictures
# ----------------------------------------------------------------------------------------------------


def cls_attention(trunk: nn.Module, x: Tensor) -> tuple[Tensor, int]:
    """The attention weights of the last block of a ViT on images ``x``: ``([B, heads, T, T], prefix)``, each row a
    softmax over the ``T`` tokens (CLS, then ``prefix - 1`` registers, then the patches in raster order).

    timm's attention computes them inside a fused kernel, so they are recomputed here from that block's own input
    (captured by a forward hook), its ``qkv`` projection, q/k norms and scale: the very weights that block multiplies
    its values by. Raises :class:`ToolError` for a trunk that is not a ViT."""
    blocks = getattr(trunk, "blocks", None)
    attn = getattr(blocks[-1], "attn", None) if blocks is not None and len(blocks) else None
    if attn is None or not hasattr(attn, "qkv") or not isinstance(trunk, TokenTrunk):
        raise ToolError(f"attention needs a ViT trunk (the CLS token's attention over the patches); "
                        f"{type(trunk).__name__} has none")
    seen: dict[str, Tensor] = {}

    def grab(part_module: nn.Module, args: tuple[Any, ...]) -> None:
        seen["x"] = args[0]

    handle = attn.register_forward_pre_hook(grab)
    try:
        with torch.no_grad():
            trunk(x)
    finally:
        handle.remove()
    tokens = seen["x"]
    b, t, c = tokens.shape
    heads = int(attn.num_heads)
    with torch.no_grad():
        qkv = attn.qkv(tokens).reshape(b, t, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
        q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
        weights = torch.softmax((q.float() * float(attn.scale)) @ k.float().transpose(-2, -1), dim=-1)
    return weights, 1 + int(getattr(trunk, "num_registers", 0))


def kept_by_mass(weights: Tensor, mass: float) -> Tensor:
    """The smallest set of entries of each row of ``weights`` ``[..., N]`` (non-negative) that holds at least ``mass``
    of the row's sum, as a boolean mask: DINO's thresholded attention (its ``visualize_attention.py`` keeps the
    patches whose sorted cumulative attention exceeds ``1 - threshold``). Ties at the boundary are all kept."""
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"mass must be in (0, 1], got {mass}")
    w = weights / weights.sum(dim=-1, keepdim=True)
    values = torch.sort(w, dim=-1, descending=True).values
    before = torch.cumsum(values, dim=-1) - values  # the mass of the larger entries
    keep_sorted = before < mass - 1e-7
    kept_min = torch.where(keep_sorted, values, torch.full_like(values, float("inf"))).amin(dim=-1, keepdim=True)
    return w >= kept_min


def patch_features(trunk: nn.Module, x: Tensor) -> Tensor:
    """Features per image location ``[B, h, w, D]``, without gradient: a ViT's patch tokens (after its final norm), a
    torchvision ResNet's last feature map (before its pooling) or the small CNN's (before its grid pooling)
    (:func:`~sslkit.models.dense.dense_features`). Raises :class:`ToolError` for another trunk."""
    if not has_feature_map(trunk):
        raise ToolError(f"pca needs features per image location: a ViT's patch tokens or a CNN's last feature map "
                        f"(sslkit's small_cnn, torchvision ResNets); {type(trunk).__name__} gives neither")
    with torch.no_grad():
        return dense_features(trunk, x).map


def principal_components(x: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """PCA of the rows of ``x`` ``[M, D]``: ``(mean [D], components [n, D], explained variance ratio [n])``, the
    components orthonormal, by decreasing variance, each signed so its largest coefficient is positive (an SVD's
    signs are arbitrary). Computed in float64."""
    data = x.double()
    mean = data.mean(dim=0)
    _, s, vh = torch.linalg.svd(data - mean, full_matrices=False)
    n = min(n, vh.shape[0])
    comps = vh[:n]
    signs = torch.sign(comps.gather(1, comps.abs().argmax(dim=1, keepdim=True)))
    comps = comps * torch.where(signs == 0, torch.ones_like(signs), signs)
    var = s.pow(2)
    ratio = var[:n] / var.sum().clamp_min(1e-300)
    return mean, comps, ratio


def foreground(first: Tensor, border: Tensor) -> tuple[Tensor, float]:
    """DINOv2's foreground / background split by the first principal component: the patches on one side of the
    midpoint of its range. ``first`` ``[M]`` holds each patch's score, ``border`` ``[M]`` whether the patch lies on
    the image's edge. The side that holds fewer of the edge patches is the foreground (objects sit in the middle
    of a picture more often than on its frame). Returns ``(mask [M] bool, threshold)``."""
    threshold = float((first.min() + first.max()) / 2)
    high = first > threshold
    edge = border.bool()
    if edge.any() and (high & edge).float().mean() > (~high & edge).float().mean():
        high = ~high
    return high, threshold


def embed_2d(features: Tensor, method: str = "auto", seed: int = 0) -> tuple[np.ndarray, str]:
    """A 2-D map of ``features`` ``[N, D]`` (L2-normalised first, the kNN protocol's cosine geometry):
    ``(coordinates [N, 2], the method's name)``. ``auto``: UMAP (umap-learn, cosine metric, 15 neighbours, min_dist
    0.1, seeded) when installed, else PCA (the first two principal components); ``umap`` without umap-learn is a
    :class:`ToolError` naming the extra to install."""
    x = F.normalize(features.double(), dim=1)
    if method in ("auto", "umap"):
        try:
            import umap
        except ImportError:
            if method == "umap":
                raise ToolError("method=umap needs umap-learn: pip install 'sslkit[viz]' (or method=pca)") from None
        else:
            n_neighbors = max(2, min(15, x.shape[0] - 1))
            reducer = umap.UMAP(n_components=2, n_neighbors=n_neighbors, min_dist=0.1, metric="cosine",
                                random_state=seed, n_jobs=1)  # seeded: one thread (umap-learn's rule)
            coords = reducer.fit_transform(x.numpy())
            from importlib.metadata import version as installed

            version = installed("umap-learn")
            return np.asarray(coords, dtype=np.float64), f"UMAP (umap-learn {version}, cosine, 15 neighbours)"
    mean, comps, ratio = principal_components(x, 2)
    coords = ((x - mean) @ comps.T).numpy()
    why = "" if method == "pca" else ", umap-learn not installed"
    shares = ", ".join(f"{100 * float(r):.1f}%" for r in ratio)
    return coords, f"PCA (components 1-2: {shares} of the variance{why})"


def nearest(memory: Tensor, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` most cosine-similar rows of ``memory`` for each query: ``(similarities [Q, k], indices [Q, k])`` by
    decreasing similarity, ties at the k-th place broken by the lower index, exactly as the kNN protocol
    (:mod:`sslkit.evaluation.knn`) picks its voters."""
    from sslkit.evaluation.knn import select_neighbours

    sim = F.normalize(queries.float(), dim=1) @ F.normalize(memory.float(), dim=1).T
    return select_neighbours(sim, min(k, memory.shape[0]))


# ----------------------------------------------------------------------------------------------------
# Images in, pictures out
# ----------------------------------------------------------------------------------------------------


@dataclass
class Shown:
    """Images as the model sees them (``inputs``, normalised) and as they are drawn (``pixels``, in [0, 1])."""

    inputs: Tensor
    pixels: Tensor
    labels: list[int]
    names: list[str]
    #: Their positions in the dataset they were read from.
    indices: list[int] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)

    def label_name(self, label: int) -> str:
        """A label as words: its class name when known, else its number (``?`` for none)."""
        if label < 0:
            return "?"
        return self.classes[label] if label < len(self.classes) else str(label)


def _eval_transform(cfg: DictConfig, size: int | None) -> dict[str, Any]:
    """The run's eval transform (``data.eval_transform``, its ``name`` included), at ``size`` when given: the crop
    ``size`` and the resize before it scaled alike."""
    spec = dict(cfg.data.eval_transform)
    spec.setdefault("name", "eval")
    spec.setdefault("image_size", int(cfg.data.image_size))
    if size is not None:
        if spec.get("resize"):
            spec["resize"] = round(int(spec["resize"]) * size / int(spec["image_size"]))
        spec["image_size"] = size
    return spec


def _transforms(cfg: DictConfig, channels: int, size: int | None) -> tuple[Any, Any]:
    """(model transform, display transform): the run's eval transform (at ``size`` when given) and the same crop
    without normalisation."""
    from sslkit.data.transforms import build_transform

    spec = _eval_transform(cfg, size)
    name = str(spec.pop("name"))
    model_t = build_transform(name, where="data.eval_transform.name", **spec)
    display_t = build_transform(name, where="data.eval_transform.name",
                                **{**spec, "mean": [0.0] * channels, "std": [1.0] * channels})
    return model_t, display_t


def _dataset(pre: Pretrained, images: str | None, split: str, channels: int) -> tuple[Any, list[str], str]:
    """The images to draw: ``(dataset, class names, what it is)``."""
    from sslkit.data.sources import DataSourceError, FileListDataset, FolderDataset
    from sslkit.tools.common import eval_split

    if images:
        path = os.path.expanduser(images)
        if not os.path.exists(path):
            raise ToolError(f"images={images}: no such file or folder. Give a folder of images, or a file list "
                            "(one 'path' or 'path,label' a line)")
        cls = FolderDataset if os.path.isdir(path) else FileListDataset
        try:
            ds = cls(path, channels=channels, probe=0)
        except DataSourceError as exc:
            raise ToolError(f"images={images}: {exc}") from None
        return ds, list(getattr(ds, "classes", [])), path
    ds, source, path = eval_split(pre, split, " (or give images=FOLDER)")
    inner = getattr(ds, "dataset", ds)
    names = list(getattr(inner, "classes", []) or CLASS_NAMES.get(str(source), []))
    return ds, names, f"the {split} split of {source}" + (f" ({path})" if path else "")


def _spread(total: int, n: int) -> list[int]:
    """``n`` indices spread evenly over ``range(total)`` (all of them when ``n`` is 0 or larger)."""
    if n <= 0 or n >= total:
        return list(range(total))
    return sorted({i * total // n for i in range(n)})


def _read(ds: Any, indices: Sequence[int], cfg: DictConfig, channels: int, size: int | None,
          classes: list[str]) -> Shown:
    """The images at ``indices``, through the model's and the display's transforms; an image that cannot be read is
    skipped with a warning naming it (none left is a :class:`ToolError`)."""
    from sslkit.data.sources import UnreadableSampleError

    model_t, display_t = _transforms(cfg, channels, size)
    inputs, pixels, labels, names, read = [], [], [], [], []
    skipped: list[str] = []
    for i in indices:
        try:
            image, label = ds[i]
        except UnreadableSampleError as exc:
            skipped.append(str(exc))
            continue
        inputs.append(model_t(image)[0])
        pixels.append(display_t(image)[0].clamp(0, 1))
        labels.append(int(label))
        read.append(int(i))
        samples = getattr(ds, "samples", None)
        names.append(os.path.basename(samples[i][0]) if samples is not None else f"#{i}")
    for reason in skipped:
        logger.warning("viz: skipped an image: %s", reason)
    if not inputs:
        raise ToolError(f"none of the {len(indices)} images could be read ({skipped[0] if skipped else 'none given'})")
    return Shown(torch.stack(inputs), torch.stack(pixels), labels, names, read, classes)


# ----------------------------------------------------------------------------------------------------
# Drawing (numpy and PIL: exact sizes, no figure machinery)
# ----------------------------------------------------------------------------------------------------


def _rgb(pixels: Tensor, scale: int) -> np.ndarray:
    """``[C, H, W]`` in [0, 1] -> uint8 ``[H * scale, W * scale, 3]`` (grey images repeated over the channels)."""
    a = pixels.detach().float().cpu().clamp(0, 1)
    if a.shape[0] == 1:
        a = a.expand(3, -1, -1)
    arr = (a[:3].permute(1, 2, 0).numpy() * 255 + 0.5).astype(np.uint8)
    return arr.repeat(scale, axis=0).repeat(scale, axis=1)


def _heat(values: np.ndarray, size: tuple[int, int], cmap: str = "inferno") -> np.ndarray:
    """A map ``[h, w]`` scaled to [0, 1] (its own min and max), coloured, and enlarged to ``size`` (nearest: each
    cell keeps its patch's edges)."""
    import matplotlib

    v = values.astype(np.float64)
    span = v.max() - v.min()
    v = (v - v.min()) / span if span > 0 else np.zeros_like(v)
    rgb = (matplotlib.colormaps[cmap](v)[..., :3] * 255 + 0.5).astype(np.uint8)
    return _enlarge(rgb, size)


def _enlarge(arr: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """``arr`` ``[h, w, ...]`` enlarged to ``size`` = (H, W) by nearest neighbour (any ratio)."""
    rows = (np.arange(size[0]) * arr.shape[0]) // size[0]
    cols = (np.arange(size[1]) * arr.shape[1]) // size[1]
    return arr[rows][:, cols]


def _blend(a: np.ndarray, b: np.ndarray, alpha: float) -> np.ndarray:
    return (a.astype(np.float32) * (1 - alpha) + b.astype(np.float32) * alpha + 0.5).astype(np.uint8)


@dataclass
class Panel:
    """One picture of a grid and the caption lines under it; ``frame`` colours its border (RGB) when set."""

    image: np.ndarray
    caption: list[str] = field(default_factory=list)
    frame: tuple[int, int, int] | None = None


def grid_size(rows: int, cols: int, cell: int, lines: int) -> tuple[int, int]:
    """``(width, height)`` in pixels of a grid of ``rows`` x ``cols`` panels of ``cell`` pixels with ``lines``
    caption lines each."""
    return cols * cell + (cols + 1) * PAD, rows * (cell + lines * LINE) + (rows + 1) * PAD


def _draw(rows: list[list[Panel]], cell: int, lines: int, path: str) -> tuple[int, int]:
    """Write a grid of panels as a PNG; returns its (width, height)."""
    from PIL import Image, ImageDraw

    cols = max(len(r) for r in rows)
    width, height = grid_size(len(rows), cols, cell, lines)
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for r, row in enumerate(rows):
        top = PAD + r * (cell + lines * LINE + PAD)
        for c, panel in enumerate(row):
            left = PAD + c * (cell + PAD)
            canvas.paste(Image.fromarray(panel.image), (left, top))
            if panel.frame is not None:
                draw.rectangle([left, top, left + cell - 1, top + cell - 1], outline=panel.frame, width=3)
            for j, text in enumerate(panel.caption[:lines]):
                draw.text((left, top + cell + j * LINE), _fit(draw, text, cell), fill=(0, 0, 0))
    _save_png(canvas, path)
    return width, height


def _fit(draw: Any, text: str, width: int) -> str:
    """``text`` cut (with an ellipsis) to fit ``width`` pixels in the default font."""
    if draw.textlength(text) <= width:
        return text
    while text and draw.textlength(text + "...") > width:
        text = text[:-1]
    return text + "..."


def _save_png(image: Any, path: str) -> None:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    atomic_write(path, lambda f: f.write(buffer.getvalue()))


def _cell(size: int) -> tuple[int, int]:
    """(panel side, enlargement factor) for images of ``size`` pixels."""
    scale = max(1, math.ceil(MIN_CELL / size))
    return size * scale, scale


def _pages(rows: list[list[Panel]]) -> list[list[list[Panel]]]:
    return [rows[i:i + ROWS_PER_FILE] for i in range(0, len(rows), ROWS_PER_FILE)]


# ----------------------------------------------------------------------------------------------------
# The kinds
# ----------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """What every kind needs: the checkpoint, the network drawn, the images and the options."""

    pre: Pretrained
    trunk: nn.Module
    part: str
    opts: dict[str, str]
    overrides: list[str]
    folder: str
    channels: int

    @property
    def size(self) -> int | None:
        """``image_size=`` as given (None: the run's eval transform)."""
        return int(self.opts["image_size"]) if "image_size" in self.opts else None

    def shown(self) -> Shown:
        """The ``n`` images attention, pca and neighbours draw."""
        ds, classes, what = _dataset(self.pre, self.opts.get("images"), self.opts.get("split", "test"), self.channels)
        n = _int(self.opts, "n", 8, 1)
        picked = _spread(len(ds), n)
        logger.info("viz: %d image(s) of %s", len(picked), what)
        return _read(ds, picked, self.pre.config, self.channels, self.size, classes)


def _int(opts: dict[str, str], key: str, default: int, low: int) -> int:
    raw = opts.get(key, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise ToolError(f"{key}={raw}: give a whole number") from None
    if value < low:
        raise ToolError(f"{key}={raw}: give a number >= {low}")
    return value


def _attention(job: Job) -> dict[str, Any]:
    raw = job.opts.get("mass", "0.6")
    try:
        mass = float(raw)
    except ValueError:
        mass = float("nan")
    if not 0 < mass <= 1:  # (NaN fails too)
        raise ToolError(f"mass={raw}: give the share of attention kept, a number in (0, 1], e.g. mass=0.6")
    shown = job.shown()
    x = shown.inputs.to(job.pre.device)
    weights, prefix = cls_attention(job.trunk, x)
    grid = job.trunk.grid(x.shape[-2], x.shape[-1])  # type: ignore[operator]
    cls_row = weights[:, :, 0, prefix:].cpu()  # [B, heads, patches]: the CLS token's attention on the patches
    kept = kept_by_mass(cls_row, mass)
    heads = cls_row.shape[1]
    cell, scale = _cell(x.shape[-1])
    rows, records = [], []
    for i in range(len(shown.labels)):
        base = _rgb(shown.pixels[i], scale)
        panels = [Panel(base, [shown.names[i], shown.label_name(shown.labels[i])])]
        mean_map = cls_row[i].mean(dim=0).reshape(grid).numpy()
        registers = f"{prefix - 1} register token(s) aside" if prefix > 1 else ""
        panels.append(Panel(_blend(base, _heat(mean_map, base.shape[:2]), 0.6), ["mean of heads", registers]))
        for h in range(heads):
            heat = _blend(base, _heat(cls_row[i, h].reshape(grid).numpy(), base.shape[:2]), 0.6)
            mask = _enlarge(kept[i, h].reshape(grid).numpy(), base.shape[:2])
            shaded = np.where(mask[..., None], heat, (heat * 0.25).astype(np.uint8))
            panels.append(Panel(shaded, [f"head {h + 1}", f"{int(kept[i, h].sum())}/{kept.shape[-1]} patches"]))
        rows.append(panels)
        records.append({"image": shown.names[i], "index": shown.indices[i], "label": shown.labels[i],
                        "kept_patches": [int(kept[i, h].sum()) for h in range(heads)],
                        "cls_share_on_patches": [round(float(weights[i, h, 0, prefix:].sum()), 6)
                                                 for h in range(heads)]})
    files = _write_pages(job.folder, "attention", rows, cell, 2)
    return {"kind": "attention", "files": files, "cell": cell, "caption_lines": 2, "mass": mass, "heads": heads,
            "grid": list(grid), "block": len(job.trunk.blocks) - 1, "images": records,  # type: ignore[arg-type]
            "about": f"The CLS token's attention over the patches in the last block, per head (panel 2: their "
                     f"mean), on the image; the bright part of each head holds {mass:.0%} of its attention on the "
                     "patches (DINO's thresholded maps), the rest is dimmed."}


#: Why a CNN's foreground and RGB panels are mostly black, said under its PCA page.
CNN_PCA = (" A CNN's panels are mostly black, and that is what its map holds, not a drawing fault: its last feature "
           "map is coarse (4 x 4 for the small CNN on 28 px images, 12 of the 16 cells on the edge), its ReLU features "
           "are skewed, and its first component follows edges and texture more than the object, so few cells lie "
           "above the midpoint of the component's range and an image with none shows black foreground and RGB "
           "panels. The first-component panel shows the whole map; image_size=112 gives a 14 x 14 map.")


def _pca(job: Job) -> dict[str, Any]:
    shown = job.shown()
    x = shown.inputs.to(job.pre.device)
    maps = patch_features(job.trunk, x).float().cpu()  # [B, h, w, D]
    b, h, w, d = maps.shape
    flat = maps.reshape(b * h * w, d)
    mean, comps, ratio = principal_components(flat, 3)
    first = (flat.double() - mean) @ comps[0]
    edge = torch.zeros(b, h, w, dtype=torch.bool)
    edge[:, 0], edge[:, -1], edge[:, :, 0], edge[:, :, -1] = True, True, True, True
    fg, threshold = foreground(first, edge.reshape(-1))
    if int(fg.sum()) >= 3:
        fg_mean, fg_comps, fg_ratio = principal_components(flat[fg], 3)
    else:  # too few foreground patches for three components: use every patch
        fg_mean, fg_comps, fg_ratio = mean, comps, ratio
    proj = (flat.double() - fg_mean) @ fg_comps.T  # [M, k]
    lo, hi = proj[fg].amin(dim=0), proj[fg].amax(dim=0)
    rgb = ((proj - lo) / (hi - lo).clamp_min(1e-12)).clamp(0, 1)
    if rgb.shape[1] < 3:
        rgb = torch.cat([rgb, rgb.new_zeros(rgb.shape[0], 3 - rgb.shape[1])], dim=1)
    rgb = torch.where(fg[:, None], rgb, torch.zeros_like(rgb)).reshape(b, h, w, 3).numpy()
    first_maps = first.reshape(b, h, w).numpy()
    fg_maps = fg.reshape(b, h, w).numpy()
    cell, scale = _cell(x.shape[-1])
    rows, records = [], []
    for i in range(b):
        base = _rgb(shown.pixels[i], scale)
        size = base.shape[:2]
        colour = _enlarge((rgb[i] * 255 + 0.5).astype(np.uint8), size)
        rows.append([Panel(base, [shown.names[i], shown.label_name(shown.labels[i])]),
                     Panel(_heat(first_maps[i], size, "coolwarm"), ["1st component", ""]),
                     Panel(_enlarge((fg_maps[i][..., None] * np.array([255, 255, 255])).astype(np.uint8), size),
                           ["foreground", f"{int(fg_maps[i].sum())}/{h * w} patches"]),
                     Panel(colour, ["PCA of foreground", "as RGB"])])
        records.append({"image": shown.names[i], "index": shown.indices[i], "label": shown.labels[i],
                        "foreground_patches": int(fg_maps[i].sum())})
    files = _write_pages(job.folder, "pca", rows, cell, 2)
    vit = isinstance(job.trunk, TokenTrunk)
    what = "patch tokens" if vit else "last feature map"
    return {"kind": "pca", "files": files, "cell": cell, "caption_lines": 2, "patch_features": what, "grid": [h, w],
            "dim": d, "explained_variance_ratio": [round(float(r), 6) for r in ratio],
            "foreground_explained_variance_ratio": [round(float(r), 6) for r in fg_ratio],
            "first_component_threshold": threshold, "images": records,
            "about": f"The {what} of all {b} images, on their first principal component (blue to red); its two sides "
                     "split foreground from background (the side holding fewer edge patches is the foreground); the "
                     "foreground patches alone, on their own first three components, shown as red, green and blue "
                     "(DINOv2's figures)." + ("" if vit else CNN_PCA)}


def _features_of(job: Job, ds: Any, indices: list[int]) -> tuple[Tensor, Tensor]:
    """The kNN protocol's features (``eval.vit_features``) of ``ds[indices]``, through the kNN tool's loader."""
    from omegaconf import OmegaConf
    from torch.utils.data import Subset

    from sslkit.evaluation.features import extract_features
    from sslkit.tools.common import amp_dtype, feature_encoder, tool_loader

    cfg = job.pre.config
    transform = OmegaConf.create(_eval_transform(cfg, job.size))
    loader = tool_loader(cfg, Subset(ds, indices), transform, job.pre.device, int(cfg.eval.knn.batch_size))
    return extract_features(feature_encoder(job.trunk, cfg), loader, job.pre.device, amp_dtype(cfg), normalize=True)


def _embedding(job: Job) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    ds, classes, what = _dataset(job.pre, job.opts.get("images"), job.opts.get("split", "test"), job.channels)
    if int(getattr(getattr(ds, "dataset", ds), "num_classes", 0)) <= 0:
        raise ToolError(f"embedding colours a labelled split by class, and {what} has no labels: leave images= out "
                        "(the run's evaluation split) or give a folder of class folders")
    method = job.opts.get("method", "auto")
    if method not in ("auto", "umap", "pca"):
        raise ToolError(f"method={method}: use method=auto, umap or pca")
    picked = _spread(len(ds), _int(job.opts, "samples", 2000, 0))
    start = time.perf_counter()
    feats, labels = _features_of(job, ds, picked)
    coords, named = embed_2d(feats, method, int(job.pre.config.seed))
    logger.info("viz: embedding of %d samples of %s by %s in %.1f s", len(picked), what, named,
                time.perf_counter() - start)
    fig, ax = plt.subplots(figsize=(8, 8), dpi=100)
    names = classes or [str(c) for c in range(int(labels.max()) + 1)]
    cmap = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"]
    for c in sorted(set(labels.tolist())):
        sel = (labels == c).numpy()
        ax.scatter(coords[sel, 0], coords[sel, 1], s=4, color=cmap(c % cmap.N),
                   label=names[c] if c < len(names) else str(c))
    ax.set_title(f"{job.pre.config.name} (step {job.pre.step}): {len(picked)} samples\n{named}", fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.legend(markerscale=3, fontsize=8, loc="best")
    path = os.path.join(job.folder, "embedding.png")
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    atomic_write(path, lambda f: f.write(buffer.getvalue()))
    data = os.path.join(job.folder, "embedding.npz")
    atomic_write(data, lambda f: np.savez(f, coords=coords, labels=labels.numpy(), indices=np.asarray(picked)))
    return {"kind": "embedding", "files": ["embedding.png"], "size": [800, 800], "method": named,
            "samples": len(picked), "data": "embedding.npz",
            "about": f"The features of {len(picked)} samples of {what} (the kNN protocol's, L2-normalised) mapped to "
                     f"2-D by {named}, coloured by class."}


def _neighbors(job: Job) -> dict[str, Any]:
    from sslkit.builder import eval_sources
    from sslkit.evaluation.knn import knn_class_scores

    cfg = job.pre.config
    k = _int(job.opts, "k", 8, 1)
    memory_set, _, num_classes = eval_sources(cfg, trunk_channels=job.pre.channels)
    inner = getattr(memory_set, "dataset", memory_set)
    source = str(cfg.eval.data.train.source or cfg.data.train.source)
    classes = list(getattr(inner, "classes", []) or CLASS_NAMES.get(source, []))
    memory_idx = _spread(len(memory_set), _int(job.opts, "memory", 0, 0))
    mem_f, mem_y = _features_of(job, memory_set, memory_idx)
    shown = job.shown()
    if not shown.classes:
        shown.classes = classes
    from sslkit.evaluation.features import extract_features
    from sslkit.tools.common import amp_dtype, feature_encoder

    batch = [{"input": [shown.inputs], "target": torch.tensor(shown.labels)}]  # as the memory: the same autocast
    q, _ = extract_features(feature_encoder(job.trunk, cfg), batch, job.pre.device, amp_dtype(cfg), normalize=True)
    sims, idx = nearest(mem_f, q, k)
    vote_k = min(int(cfg.eval.knn.k), len(mem_f))
    scores = knn_class_scores(mem_f, mem_y, q, num_classes, vote_k, float(cfg.eval.knn.temperature))
    predicted = scores.argmax(dim=1)
    shown_mem = _read(memory_set, [memory_idx[j] for j in idx.reshape(-1).tolist()], cfg, job.channels, job.size,
                      classes)
    cell, scale = _cell(shown.inputs.shape[-1])
    rows, records = [], []
    for i in range(len(shown.labels)):
        label = shown.labels[i]
        pred = int(predicted[i])
        verdict = None if label < 0 else ((40, 160, 40) if pred == label else (200, 40, 40))
        panels = [Panel(_rgb(shown.pixels[i], scale), [f"{shown.names[i]} {shown.label_name(label)}",
                                                       f"kNN: {shown.label_name(pred)}"], verdict)]
        for j in range(idx.shape[1]):
            n = i * idx.shape[1] + j
            nl = shown_mem.labels[n]
            frame = None if label < 0 else ((40, 160, 40) if nl == label else (200, 40, 40))
            caption = [shown.label_name(nl), f"sim {float(sims[i, j]):.3f}"]
            panels.append(Panel(_rgb(shown_mem.pixels[n], scale), caption, frame))
        rows.append(panels)
        records.append({"query": shown.names[i], "index": shown.indices[i], "label": label, "knn_prediction": pred,
                        "neighbours": [memory_idx[j] for j in idx[i].tolist()],
                        "neighbour_labels": [int(mem_y[j]) for j in idx[i].tolist()],
                        "similarities": [round(float(s), 6) for s in sims[i]]})
    files = _write_pages(job.folder, "neighbors", rows, cell, 2)
    return {"kind": "neighbors", "files": files, "cell": cell, "caption_lines": 2, "k": k, "memory": len(mem_f),
            "vote": {"k": vote_k, "temperature": float(cfg.eval.knn.temperature)}, "queries": records,
            "about": f"Each query and its {k} most cosine-similar training images of the kNN memory ({len(mem_f)} "
                     "samples of the evaluation train split), as the kNN protocol finds them; green frames share the "
                     f"query's class, red ones do not; under the query, 'kNN:' is the protocol's weighted vote "
                     f"(k={vote_k}), its frame green when the vote is right."}


def _write_pages(folder: str, kind: str, rows: list[list[Panel]], cell: int, lines: int) -> list[str]:
    files = []
    pages = _pages(rows)
    for p, page in enumerate(pages):
        name = f"{kind}.png" if len(pages) == 1 else f"{kind}_{p + 1}.png"
        _draw(page, cell, lines, os.path.join(folder, name))
        files.append(name)
    return files


_DRAW = {"attention": _attention, "pca": _pca, "embedding": _embedding, "neighbors": _neighbors}


# ----------------------------------------------------------------------------------------------------
# The pages
# ----------------------------------------------------------------------------------------------------


def _page(title: str, sections: list[tuple[str, dict[str, Any], str]]) -> str:
    """An HTML page showing each kind's pictures (``(kind, record, relative folder)``) with what they show."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:sans-serif;margin:2em;max-width:1400px}img{max-width:100%;"
             "border:1px solid #ccc;margin:0.5em 0}p.about{color:#333}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    for kind, record, where in sections:
        parts.append(f"<h2>{html.escape(kind)}</h2><p class='about'>{html.escape(record.get('about', ''))}</p>")
        for name in record.get("files", []):
            src = f"{where}/{name}" if where else name
            parts.append(f"<img src='{html.escape(src)}' alt='{html.escape(kind)}'>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _write_text(path: str, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def _indexes(root: str, title: str) -> None:
    """``<root>/<kind>/index.html`` for the kinds drawn now, and ``<root>/index.html`` for every kind there."""
    sections = []
    for kind in KINDS:
        record_path = os.path.join(root, kind, f"{kind}.json")
        if not os.path.exists(record_path):
            continue
        with open(record_path, encoding="utf-8") as f:
            record = json.load(f)
        _write_text(os.path.join(root, kind, "index.html"), _page(f"{title}: {kind}", [(kind, record, "")]))
        sections.append((kind, record, kind))
    _write_text(os.path.join(root, "index.html"), _page(title, sections))


# ----------------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------------


def _kinds(opts: dict[str, str], trunk: nn.Module) -> list[str]:
    vit = isinstance(trunk, TokenTrunk)
    works = [k for k in KINDS if vit or k != "attention"]
    if "kind" not in opts or opts["kind"] in ("", "all"):
        return works
    asked = [k.strip() for k in opts["kind"].split(",") if k.strip()]
    for k in asked:
        if k not in KINDS:
            from sslkit.errors import did_you_mean

            raise ToolError(f"kind={k}: unknown.{did_you_mean(k, list(KINDS))} Use one or more of {', '.join(KINDS)}")
        if k not in works:
            raise ToolError(f"kind={k} needs a ViT trunk (the CLS token's attention over patches); this trunk "
                            f"({type(trunk).__name__}) is a CNN: use kind={','.join(works)}")
    return asked


def _viz(args: list[str]) -> int:
    from sslkit.tools.common import features_part, parse_tool_args, part_module, tool_pretrained

    opts, overrides = parse_tool_args("viz", args, VIZ_KEYS)
    if opts.get("split", "test") not in ("train", "test"):
        raise ToolError(f"split={opts['split']}: use split=test or split=train")
    pre = tool_pretrained("viz", opts, overrides)
    part = features_part(opts, ("trunk", "teacher"))
    trunk = part_module(pre, part).eval()
    kinds = _kinds(opts, trunk)
    channels = int(next(p for p in trunk.parameters() if p.ndim == 4).shape[1])
    if "image_size" in opts:
        size = _int(opts, "image_size", 0, 1)
        patch = getattr(trunk, "patch_size", None)
        if patch and size % int(patch):
            raise ToolError(f"image_size={size}: a ViT takes multiples of its patch size, {patch}")
    root = opts.get("output") or os.path.join(pre.run_dir, "viz")
    title = f"{pre.config.name}: {pre.config.method.name}, {pre.config.model.trunk} ({part}), step {pre.step}"
    for kind in kinds:
        folder = os.path.join(root, kind)
        os.makedirs(folder, exist_ok=True)
        start = time.perf_counter()
        job = Job(pre, trunk, part, opts, overrides, folder, channels)
        record = _DRAW[kind](job)
        record.update({"checkpoint": pre.path, "step": pre.step, "features": part,
                       "time_s": round(time.perf_counter() - start, 2)})
        _write_text(os.path.join(folder, f"{kind}.json"), json.dumps(record, indent=1))
        logger.info("viz %s: %s in %s (%.1f s)", kind, ", ".join(record["files"]), folder, record["time_s"])
    _indexes(root, title)
    logger.info("viz: open %s", os.path.join(root, "index.html"))
    return 0


def viz_main(argv: list[str] | None = None) -> int:
    """``sslkit viz checkpoint=RUN_DIR [kind=attention,pca,embedding,neighbors] [images=FOLDER] ...``"""
    from sslkit.tools.common import run_tool, tool_usage

    usage = tool_usage("viz", "pictures of what the encoder learned, with an index.html, into <run>/viz/<kind>/: "
                              "attention (a ViT's CLS attention per head), pca (patch features as RGB), embedding "
                              "(a 2-D map of a labelled split), neighbors (queries and their kNN neighbours)", VIZ_KEYS)
    return run_tool("viz", _viz, argv, usage)
