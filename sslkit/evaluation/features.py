"""The features evaluations read (a trunk's, or a ViT's tokens), and their extraction for kNN and linear evaluation."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sslkit.distributed import gather_no_grad, is_distributed
from sslkit.models.tokens import FEATURE_KINDS, TokenTrunk

__all__ = ["FeatureEncoder", "extract_features", "pixel_features"]

# Rows gathered per collective in distributed runs: bounds the device memory of the gather.
_GATHER_ROWS = 8192


class FeatureEncoder(nn.Module):
    """A trunk seen through the features an evaluation reads (``eval.vit_features``, ``eval.vit_last_n``).

    ``pool`` is the trunk's own output, for any trunk (a CNN's features, a ViT's pooling). A ViT (a
    :class:`~sslkit.models.tokens.TokenTrunk`) also gives ``cls`` (the CLS token), ``avg`` (the mean patch token),
    ``cls+avg`` (both, concatenated) and ``cls_last_n`` (the CLS tokens of the last ``last_n`` blocks, each through
    the final norm, concatenated: DINO's linear evaluation), through its ``features(x, kind, last_n)``. kNN, the linear
    probe, extraction and fine-tuning all read their features through this one module; it holds the trunk as a
    submodule (``trunk``), so its train / eval mode and its parameters are the trunk's.
    """

    def __init__(self, trunk: nn.Module, kind: str = "pool", last_n: int = 4) -> None:
        """Raises ValueError for an unknown ``kind``, a kind other than ``pool`` on a trunk without tokens, or a
        ``last_n`` outside ``[1, number of blocks]``."""
        super().__init__()
        if kind not in FEATURE_KINDS:
            raise ValueError(f"unknown feature kind {kind!r}: use one of {', '.join(FEATURE_KINDS)}")
        self.is_vit = isinstance(trunk, TokenTrunk)
        if kind != "pool" and not self.is_vit:
            raise ValueError(f"{kind} features are read from a ViT's tokens, and {type(trunk).__name__} has none: "
                             "only pool (the trunk's own features)")
        if kind == "cls_last_n":
            blocks = len(trunk.blocks)  # type: ignore[arg-type]
            if not 1 <= last_n <= blocks:
                raise ValueError(f"the CLS tokens of the last {last_n} blocks: this ViT has {blocks}, so last_n must "
                                 f"be in [1, {blocks}]")
        self.trunk = trunk
        self.kind = kind
        self.last_n = int(last_n)

    def forward(self, x: Tensor) -> Tensor:
        """The features ``[B, out_dim]`` of images ``x`` ``[B, C, H, W]``."""
        if self.kind == "pool":
            return self.trunk(x)
        return self.trunk.features(x, self.kind, self.last_n)  # type: ignore[operator]

    @property
    def out_dim(self) -> int | None:
        """The feature dimension (None when the trunk does not say its ``out_dim``)."""
        dim = getattr(self.trunk, "out_dim", None)
        if dim is None or self.kind == "pool":
            return dim
        width = int(getattr(self.trunk, "embed_dim", dim))
        return {"cls": width, "avg": width, "cls+avg": 2 * width, "cls_last_n": self.last_n * width}[self.kind]

    def describe(self) -> dict[str, Any]:
        """What a results file records: ``vit_features`` (the kind; None for a trunk without tokens, whose features
        are its own) and ``vit_last_n`` (with ``cls_last_n`` only, else None)."""
        return {"vit_features": self.kind if self.is_vit else None,
                "vit_last_n": self.last_n if self.kind == "cls_last_n" else None}


def _first_view(batch: Mapping[str, Any]) -> Tensor:
    """The first view of ``batch["input"]`` (a list/tuple of views, or a single view tensor)."""
    views = batch["input"]
    if isinstance(views, Tensor):
        return views
    return views[0]


def _collect(
    fn: Callable[[Tensor], Tensor], loader: Iterable, device: torch.device, normalize: bool
) -> tuple[Tensor, Tensor]:
    """Apply ``fn`` to the first view of every batch; float32 CPU ``[N, D]`` features and ``[N]`` labels.

    In a distributed run the per-rank results are gathered so every rank returns all of them: in dataset order with
    each sample once when the batches carry ``data_idx`` (sslkit's loaders; the sampler pads the last ranks by
    repeating samples), else rank after rank.
    """
    feats: list[Tensor] = []
    labels: list[Tensor] = []
    indices: list[Tensor] = []
    for batch in loader:
        x = _first_view(batch).to(device, non_blocking=True)
        out = fn(x)
        if not isinstance(out, Tensor):
            raise TypeError(f"encoder must return a Tensor, got {type(out).__name__}")
        out = out.reshape(out.shape[0], -1).float()
        if normalize:
            out = F.normalize(out, dim=1)
        feats.append(out.cpu())
        labels.append(torch.as_tensor(batch["target"]).reshape(-1).long().cpu())
        if "data_idx" in batch:
            indices.append(torch.as_tensor(batch["data_idx"]).reshape(-1).long().cpu())

    if feats:
        features, targets = torch.cat(feats), torch.cat(labels)
    else:
        features, targets = torch.zeros(0, 0), torch.zeros(0, dtype=torch.long)
    if features.shape[0] != targets.shape[0]:
        raise ValueError(f"{features.shape[0]} features but {targets.shape[0]} labels")
    if is_distributed():
        if len(indices) == len(feats) and feats:
            # the sampler pads the last ranks by repeating samples: gather the dataset indices too, keep each
            # sample once, in dataset order, so N processes evaluate exactly what one does
            keyed = torch.stack([targets, torch.cat(indices)], dim=1)
            features, keyed = _gather_unequal(features, keyed, device)
            order = torch.argsort(keyed[:, 1], stable=True)
            index = keyed[order, 1]
            first = torch.ones_like(index, dtype=torch.bool)
            first[1:] = index[1:] != index[:-1]
            order = order[first]
            return features[order], keyed[order, 0]
        features, targets = _gather_unequal(features, targets, device)
    return features, targets


def _gather_unequal(features: Tensor, labels: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """All-gather per-rank ``[n_r, D]`` features and ``[n_r]`` labels whose ``n_r`` may differ.

    Sizes are all-gathered first; every rank pads to the largest size, the padded tensors are
    gathered in blocks of ``_GATHER_ROWS`` rows (so the device holds one block at a time), and each
    rank's padding is cut off. The result is rank 0's rows, then rank 1's, ... on the CPU.
    Communication uses ``device`` (CUDA for NCCL, CPU for gloo).
    """
    n, d = features.shape
    sizes = gather_no_grad(torch.tensor([[n, d]], dtype=torch.long, device=device)).cpu()
    counts = sizes[:, 0].tolist()
    dims = {d_r for n_r, d_r in sizes.tolist() if n_r > 0}
    if len(dims) > 1:
        raise ValueError(f"feature dims differ across ranks: {sorted(dims)}")
    dim = dims.pop() if dims else 0
    max_n = max(counts)
    world = len(counts)
    if max_n == 0:
        return torch.zeros(0, dim), torch.zeros(0, *labels.shape[1:], dtype=torch.long)

    padded = torch.zeros(max_n, dim, dtype=torch.float32)
    padded[:n] = features.reshape(n, dim)
    padded_labels = torch.full((max_n, *labels.shape[1:]), -1, dtype=torch.long)
    padded_labels[:n] = labels

    per_rank_feats: list[list[Tensor]] = [[] for _ in range(world)]
    per_rank_labels: list[list[Tensor]] = [[] for _ in range(world)]
    for start in range(0, max_n, _GATHER_ROWS):  # same number of blocks on every rank
        block = gather_no_grad(padded[start : start + _GATHER_ROWS].to(device)).cpu()
        block_labels = gather_no_grad(padded_labels[start : start + _GATHER_ROWS].to(device)).cpu()
        rows = block.shape[0] // world
        for r in range(world):
            per_rank_feats[r].append(block[r * rows : (r + 1) * rows])
            per_rank_labels[r].append(block_labels[r * rows : (r + 1) * rows])

    out_feats = [torch.cat(per_rank_feats[r])[: counts[r]] for r in range(world)]
    out_labels = [torch.cat(per_rank_labels[r])[: counts[r]] for r in range(world)]
    return torch.cat(out_feats), torch.cat(out_labels)


@torch.no_grad()
def extract_features(
    encoder: nn.Module,
    loader: Iterable,
    device: torch.device,
    amp_dtype: torch.dtype | None = None,
    normalize: bool = True,
) -> tuple[Tensor, Tensor]:
    """Encode the first view of every batch with a frozen ``encoder``; returns CPU ``(features, labels)``.

    The frozen-feature step of the kNN protocol (Wu et al. 2018; DINO ``eval_knn``) and of linear
    probing. ``loader`` yields dicts with ``"input"`` (a list of views; the first is used) and
    ``"target"``. The encoder runs in eval mode (every submodule's previous train/eval flag is
    restored afterwards, even on error), under ``torch.autocast(device.type, amp_dtype)`` when
    ``amp_dtype`` is given. Outputs are flattened to ``[B, D]``, cast to float32 and, if
    ``normalize``, L2-normalised. Returns float32 ``[N, D]`` features and int64 ``[N]`` labels on
    the CPU. With ``torch.distributed`` initialised and more than one process, every rank returns
    the features of all ranks (dataset order without the sampler's repeats when batches carry ``data_idx``, else
    rank order; unequal per-rank sizes are handled).
    """
    modes = [(m, m.training) for m in encoder.modules()]
    encoder.eval()

    def run(x: Tensor) -> Tensor:
        if amp_dtype is None:
            return encoder(x)
        with torch.autocast(device_type=device.type, dtype=amp_dtype):
            return encoder(x)

    try:
        return _collect(run, loader, device, normalize)
    finally:
        for module, mode in modes:
            module.training = mode


@torch.no_grad()
def pixel_features(loader: Iterable, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Raw-pixel baseline for kNN: the first view flattened, cast to float32 and L2-normalised.

    Returns float32 CPU ``[N, C*H*W]`` features and int64 ``[N]`` labels, gathered over ranks in a
    distributed run like :func:`extract_features`. ``device`` (default CPU) is where the flattening
    and, in distributed runs, the communication happen: pass the CUDA device under NCCL.
    """
    return _collect(lambda x: x.float(), loader, device or torch.device("cpu"), normalize=True)
