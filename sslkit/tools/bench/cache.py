"""The feature cache of ``sslkit bench``: features extracted once per (weights, dataset content, transform,
corruption), stored memory-mapped under a key that changes when any of them does, shared by every protocol and
every later call."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset

from sslkit.data.sources import UnreadableSampleError
from sslkit.data.transforms import EvalTransform
from sslkit.evaluation.corruptions import corrupt
from sslkit.evaluation.dense import windowed_maps
from sslkit.models.dense import dense_features, has_feature_map
from sslkit.models.tokens import TokenTrunk

__all__ = ["BenchImages", "FeatureCache", "batched", "data_fingerprint", "extract_arrays", "extraction_workers",
           "module_heads", "module_patch", "patch_tokens", "protocol_capable", "summary", "token_capable", "token_maps",
           "vit_summary"]

#: Bumped when what an entry holds or how it is computed changes: older entries are then not read.
FORMAT = 1


class FeatureCache:
    """Folders ``<root>/<key>/`` holding ``.npy`` arrays and ``meta.json``, written whole (into a temporary folder,
    then renamed: a killed extraction leaves no half entry) and read memory-mapped."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))

    @staticmethod
    def key(parts: dict[str, Any]) -> str:
        """The entry of ``parts`` (everything the features depend on), a SHA-256 of their JSON."""
        text = json.dumps({"format": FORMAT, **parts}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def path(self, key: str) -> str:
        """The folder of entry ``key``."""
        return os.path.join(self.root, key)

    def load(self, key: str) -> dict[str, np.ndarray] | None:
        """The arrays of entry ``key``, memory-mapped read-only, or None when it is not (wholly) there."""
        folder = self.path(key)
        meta = os.path.join(folder, "meta.json")
        if not os.path.isfile(meta):
            return None
        with open(meta, encoding="utf-8") as f:
            names = json.load(f)["arrays"]
        try:
            return {n: np.load(os.path.join(folder, f"{n}.npy"), mmap_mode="r") for n in names}
        except (OSError, ValueError):
            return None

    def store(self, key: str, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Write entry ``key`` whole: the arrays, then ``meta.json`` (the entry's commit), then one rename."""
        os.makedirs(self.root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=self.root)
        try:
            for name, value in arrays.items():
                np.save(os.path.join(tmp, f"{name}.npy"), value)
            record = {**meta, "arrays": sorted(arrays), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "bytes": int(sum(v.nbytes for v in arrays.values()))}
            with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1, default=str)
            target = self.path(key)
            if os.path.isdir(target):
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)

    def entries(self) -> list[dict[str, Any]]:
        """The ``meta.json`` of every whole entry, with its ``key``."""
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in sorted(os.listdir(self.root)):
            meta = os.path.join(self.root, name, "meta.json")
            if not name.startswith(".") and os.path.isfile(meta):
                with open(meta, encoding="utf-8") as f:
                    found.append({"key": name, **json.load(f)})
        return found


def extraction_workers(dataset: Dataset, workers: int) -> int:
    """The loader processes an extraction of ``dataset`` uses: none for images held in memory and not corrupted
    (their batched transform costs far less than a worker's hand-over: Fashion-MNIST, CIFAR), else ``workers``
    (files to decode, corruptions to draw)."""
    base = _unwrap(dataset)
    if isinstance(base, BenchImages):
        if base.corruption is not None:
            return workers
        base = _unwrap(base.source)
    return 0 if isinstance(getattr(base, "images", None), Tensor) else workers


def _unwrap(dataset: Dataset) -> Any:
    """The dataset below any :class:`Subset` of it."""
    base: Any = dataset
    while isinstance(base, Subset):
        base = base.dataset
    return base


def data_fingerprint(dataset: Dataset, path: str | None, spec: dict[str, Any] | None = None) -> str:
    """What identifies a dataset's content: its ``spec`` (source, arguments, split), the rows a subset keeps, and
    the SHA-256 of its images and labels when it holds them in memory (Fashion-MNIST, CIFAR), else of every file
    under its ``path`` (relative name, size, modification time in ns: a rewritten image is another fingerprint).
    A source made from its arguments alone (synthetic) is identified by them."""
    h = hashlib.sha256(json.dumps(spec or {}, sort_keys=True, default=str).encode())
    base: Any = dataset
    while isinstance(base, Subset):
        h.update(np.asarray(base.indices, dtype=np.int64).tobytes())
        base = base.dataset
    h.update(f"{type(base).__name__}:{len(base)}".encode())  # type: ignore[arg-type]
    images = getattr(base, "images", None)
    if isinstance(images, Tensor):
        h.update(images.contiguous().numpy().tobytes())
        h.update(base.labels.numpy().tobytes())
        return h.hexdigest()
    for name in _files(path):
        st = os.stat(name)
        h.update(f"{os.path.relpath(name, path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    samples = getattr(base, "samples", None)
    if samples is not None:
        h.update(json.dumps([[str(s), int(y)] for s, y in samples]).encode())
    return h.hexdigest()


def _files(path: str | None) -> Iterator[str]:
    if not path:
        return
    path = os.path.expanduser(path)
    if os.path.isfile(path):
        yield path
        return
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for n in sorted(names):
            yield os.path.join(root, n)


class BenchImages(Dataset):
    """A labelled source's images as a backbone reads them: optionally corrupted (``corruption`` = (kind, severity,
    table), each image's noise seeded by its index), gray repeated to the backbone's 3 channels, then the
    evaluation transform (shorter-side resize, centre crop, normalisation). Items: (image, label, index); an image
    that cannot be read is a blank one with label -1, which every protocol leaves out. A loader fetches whole
    batches (:meth:`__getitems__`)."""

    def __init__(self, source: Dataset, transform: dict[str, Any], corruption: tuple[str, int, str] | None = None,
                 seed: int = 0) -> None:
        self.source, self.corruption, self.seed = source, corruption, int(seed)
        self.channels = transform.get("channels")
        self.transform = EvalTransform(int(transform["image_size"]), transform.get("resize"), transform.get("mean"),
                                       transform.get("std"), transform.get("crop_pct"))

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def _read(self, i: int) -> tuple[Tensor | None, int]:
        """Image ``i`` corrupted and with the backbone's channels, before the transform; (None, -1) unreadable."""
        try:
            image, label = self.source[i]
        except UnreadableSampleError:  # left out of every protocol, for every backbone alike (label -1)
            return None, -1
        if self.corruption is not None:
            kind, severity, table = self.corruption
            image = corrupt(image, kind, severity, table, seed=self.seed * 1_000_003 + i)
        if self.channels and image.shape[0] != self.channels:
            if image.shape[0] != 1:
                raise ValueError(f"the images have {image.shape[0]} channels and the backbone takes {self.channels}")
            image = image.expand(self.channels, -1, -1)
        return image, int(label)

    def _blank(self) -> Tensor:
        size = self.transform.image_size
        return torch.zeros(self.channels or int(getattr(_unwrap(self.source), "channels", 3)), size, size)

    def __getitem__(self, i: int) -> tuple[Tensor, int, int]:
        image, label = self._read(i)
        return (self._blank() if image is None else self.transform(image.contiguous())[0]), label, i

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """A whole batch ``(images [B, C, S, S], labels [B], indices [B])`` for the loader (``collate_fn``
        :func:`batched`): the images of one size are transformed together (:meth:`EvalTransform.batch
        <sslkit.data.transforms.EvalTransform.batch>`, the same values as one by one), so that a fast model is not
        kept waiting by a Python call per image."""
        read = [self._read(i) for i in indices]
        sizes = {tuple(im.shape) for im, _ in read if im is not None}
        if len(sizes) == 1:
            readable = [k for k, (im, _) in enumerate(read) if im is not None]
            done = self.transform.batch(torch.stack([read[k][0] for k in readable]))  # type: ignore[misc]
            out = [self._blank() for _ in read] if len(readable) < len(read) else list(done)
            for j, k in enumerate(readable):
                out[k] = done[j]
        else:
            out = [self._blank() if im is None else self.transform(im.contiguous())[0] for im, _ in read]
        return (torch.stack(out), torch.tensor([y for _, y in read], dtype=torch.int64),
                torch.tensor(indices, dtype=torch.int64))


def batched(batch: Any) -> Any:
    """The loader's ``collate_fn`` for a dataset whose ``__getitems__`` gives the batch whole."""
    return batch


def vit_summary(trunk: TokenTrunk, x: Tensor, last_n: int) -> dict[str, Tensor]:
    """One forward of a ViT giving ``cls_last`` ``[B, n, D]`` (the CLS token of each of the last ``last_n`` blocks
    through the final norm, oldest first: DINOv2's ``n_last_blocks``) and ``avg`` ``[B, D]`` (the mean of the final
    normed patch tokens, register tokens left out: its ``avgpool``). The blocks' outputs are read by forward hooks
    on ``trunk.blocks``, so the trunk's own ``forward_tokens`` runs once."""
    blocks = list(trunk.blocks)  # type: ignore[arg-type]
    n = min(int(last_n), len(blocks))
    seen: list[Tensor] = []
    handles = [b.register_forward_hook(lambda _m, _i, out: seen.append(out)) for b in blocks[-n:]]
    try:
        tokens = trunk.forward_tokens(x)
    finally:
        for h in handles:
            h.remove()
    norm: nn.Module = trunk.norm  # type: ignore[assignment]
    cls = [norm(t)[:, 0] for t in seen[:-1]] + [tokens.cls]
    return {"cls_last": torch.stack(cls, dim=1).float(), "avg": tokens.patches.float().mean(dim=1)}


def token_capable(module: nn.Module | None) -> bool:
    """Does the backbone give patch tokens (the attentive and dense protocols)? A sslkit ViT trunk, a timm ViT (a
    model with ``patch_embed`` and ``num_prefix_tokens``), and the raw pixels (their patches); not a CNN."""
    return module is None or isinstance(module, TokenTrunk) or (
        hasattr(module, "patch_embed") and hasattr(module, "num_prefix_tokens"))


def protocol_capable(module: nn.Module | None, protocol: str) -> bool:
    """Can the backbone be measured by a patch-token protocol? The attentive probe reads patch tokens
    (:func:`token_capable`); the dense probe reads any feature map: a ViT's patch tokens, a CNN's last map
    (:func:`~sslkit.models.dense.has_feature_map`: a torchvision ResNet, sslkit's small CNN, a trunk's own
    ``forward_dense``), the pixels."""
    return token_capable(module) or (protocol == "dense" and has_feature_map(module))  # type: ignore[arg-type]


def module_heads(module: nn.Module | None) -> int:
    """The attention heads of a token backbone's blocks (the attentive probe's, as V-JEPA takes the encoder's); 1
    for the pixels."""
    if module is None:
        return 1
    if isinstance(module, TokenTrunk):
        return int(module.num_heads)
    return int(module.blocks[0].attn.num_heads)  # type: ignore[index, union-attr]


def patch_tokens(module: nn.Module | None, x: Tensor, patch: int) -> Tensor:
    """The last layer's patch tokens ``[B, n, D]`` in raster order, after the final norm, without CLS and register
    tokens: a sslkit ViT's ``forward_tokens``, a timm ViT's ``forward_features`` less its prefix tokens, or, for the
    pixels (``module`` None), each ``patch`` x ``patch`` patch of the image flattened (channel-major)."""
    if module is None:
        return F.unfold(x.float(), patch, stride=patch).transpose(1, 2)
    if isinstance(module, TokenTrunk):
        return module.forward_tokens(x).patches.float()
    out = module.forward_features(x)  # type: ignore[operator]
    return out[:, int(module.num_prefix_tokens):].float()


def module_patch(module: nn.Module | None, pixels: int) -> int:
    """The patch side of a token backbone: a ViT's own, ``pixels`` for the raw pixels."""
    if module is None:
        return int(pixels)
    if isinstance(module, TokenTrunk):
        return int(module.patch_size)
    return int(module.patch_embed.patch_size[0])  # type: ignore[index, union-attr]


def token_maps(module: nn.Module | None, x: Tensor, patch: int, window: int | None = None) -> Tensor:
    """:func:`patch_tokens` as a feature map ``[B, D, h, w]`` (the dense probe's input), read through windows of
    ``window`` pixels when the images are larger (:func:`~sslkit.evaluation.dense.windowed_maps`; not for the
    pixels, whose patches see nothing else); a CNN's last feature map (:func:`~sslkit.models.dense.dense_features`)
    of the whole image."""
    if module is not None and not token_capable(module):  # a CNN: its last feature map, any image size in one pass
        return dense_features(module, x).map.permute(0, 3, 1, 2).float()
    side = module_patch(module, patch)

    def whole(images: Tensor) -> Tensor:
        tokens = patch_tokens(module, images, side)
        return tokens.transpose(1, 2).reshape(images.shape[0], tokens.shape[2], images.shape[-2] // side, -1)
    return whole(x) if module is None else windowed_maps(whole, x, window, side)


def summary(module: nn.Module | None, last_n: int) -> Callable[[Tensor], dict[str, Tensor]]:
    """What the classification protocols read of a batch: ``pool`` (a trunk's output; the flattened image for the
    pixels) or, for a ViT, ``cls_last`` and ``avg`` (:func:`vit_summary`)."""
    def run(x: Tensor) -> dict[str, Tensor]:
        if module is None:
            return {"pool": x.reshape(x.shape[0], -1).float()}
        if isinstance(module, TokenTrunk):
            return vit_summary(module, x, last_n)
        f = module(x)
        return {"pool": f.reshape(f.shape[0], -1).float()}
    return run


def extract_arrays(module: nn.Module | None, dataset: Dataset, device: torch.device, batch_size: int,
                   workers: int, summarize: Callable[[Tensor], dict[str, Tensor]], target: str = "labels",
                   progress: Callable[[int], None] | None = None, half: tuple[str, ...] = ()
                   ) -> dict[str, np.ndarray]:
    """Every image's features, in dataset order, on the CPU: ``summarize(batch)`` (float32, or float16 for the
    names in ``half``: patch tokens and maps, whose size a float32 copy would double), with the items' second
    element as ``target`` (``labels`` int64, or ``masks``: class maps as uint8). The network runs in eval mode under
    ``no_grad``; ``progress(images)`` after every batch."""
    whole = isinstance(_unwrap(dataset), BenchImages)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers,
                        pin_memory=device.type == "cuda", persistent_workers=False,
                        collate_fn=batched if whole else None)
    parts: dict[str, list[Tensor]] = {}
    targets: list[Tensor] = []
    if module is not None:
        module.to(device).eval()
    with torch.no_grad():
        for batch in loader:
            x = batch[0].to(device, non_blocking=True)
            for k, v in summarize(x).items():
                parts.setdefault(k, []).append(v.to(torch.float16 if k in half else torch.float32).cpu())
            targets.append(batch[1].to(torch.uint8 if target == "masks" else torch.int64))
            if progress is not None:
                progress(int(x.shape[0]))
    arrays = {k: torch.cat(v).numpy() for k, v in parts.items()}
    arrays[target] = torch.cat(targets).numpy() if targets else np.zeros(0, dtype=np.int64)
    return arrays
