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
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset

from sslkit.data.sources import UnreadableSampleError
from sslkit.data.transforms import EvalTransform
from sslkit.evaluation.corruptions import corrupt
from sslkit.models.tokens import TokenTrunk

__all__ = ["BenchImages", "FeatureCache", "data_fingerprint", "extract_arrays", "vit_summary"]

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
    that cannot be read is a blank one with label -1, which every protocol leaves out."""

    def __init__(self, source: Dataset, transform: dict[str, Any], corruption: tuple[str, int, str] | None = None,
                 seed: int = 0) -> None:
        self.source, self.corruption, self.seed = source, corruption, int(seed)
        self.channels = transform.get("channels")
        self.transform = EvalTransform(int(transform["image_size"]), transform.get("resize"), transform.get("mean"),
                                       transform.get("std"), transform.get("crop_pct"))

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[Tensor, int, int]:
        try:
            image, label = self.source[i]
        except UnreadableSampleError:  # left out of every protocol, for every backbone alike (label -1)
            size = self.transform.image_size
            return torch.zeros(self.channels or int(getattr(self.source, "channels", 3)), size, size), -1, i
        if self.corruption is not None:
            kind, severity, table = self.corruption
            image = corrupt(image, kind, severity, table, seed=self.seed * 1_000_003 + i)
        if self.channels and image.shape[0] != self.channels:
            if image.shape[0] != 1:
                raise ValueError(f"the images have {image.shape[0]} channels and the backbone takes {self.channels}")
            image = image.expand(self.channels, -1, -1).contiguous()
        return self.transform(image)[0], int(label), i


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


def extract_arrays(module: nn.Module | None, dataset: BenchImages, device: torch.device, batch_size: int,
                   workers: int, last_n: int, progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """Every image's features, in dataset order, float32 on the CPU: ``pool`` (a trunk's output; the flattened
    image for ``module`` None, the raw pixels) or, for a ViT, ``cls_last`` and ``avg`` (:func:`vit_summary`); with
    ``labels``. The network runs in eval mode under ``no_grad``; ``progress(images)`` after every batch."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers,
                        pin_memory=device.type == "cuda", persistent_workers=False)
    parts: dict[str, list[Tensor]] = {}
    labels: list[Tensor] = []
    if module is not None:
        module.to(device).eval()
    with torch.no_grad():
        for x, y, _ in loader:
            x = x.to(device, non_blocking=True)
            if module is None:
                out = {"pool": x.reshape(x.shape[0], -1).float()}
            elif isinstance(module, TokenTrunk):
                out = vit_summary(module, x, last_n)
            else:
                f = module(x)
                out = {"pool": f.reshape(f.shape[0], -1).float()}
            for k, v in out.items():
                parts.setdefault(k, []).append(v.cpu())
            labels.append(y.long())
            if progress is not None:
                progress(int(x.shape[0]))
    arrays = {k: torch.cat(v).numpy() for k, v in parts.items()}
    arrays["labels"] = torch.cat(labels).numpy() if labels else np.zeros(0, dtype=np.int64)
    return arrays
