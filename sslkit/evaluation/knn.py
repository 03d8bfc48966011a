"""Weighted k-nearest-neighbour classification of frozen features (InstDisc kNN monitor)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["knn_class_scores", "knn_predictions", "ranked_neighbours", "weighted_knn"]


def select_neighbours(sim: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-``k`` columns of each row of ``sim``, ties at the k-th value broken by lower column index.

    ``torch.topk`` does not specify which of several equal values it returns when they straddle
    the k-th place. Rows where that happens (more than ``k`` values >= the k-th largest) are
    redone exactly: every column strictly above the k-th value, then the columns equal to it in
    increasing index order until ``k`` are taken. Returns ``(similarities, indices)``, both
    ``[Q, k]``, by decreasing similarity; the order among equal similarities inside the set does
    not affect the class scores (equal weights are added), so it is left to ``topk``.
    """
    vals, idx = torch.topk(sim, k, dim=1)
    kth = vals[:, -1:]
    straddle = ((sim >= kth).sum(dim=1) > k).nonzero(as_tuple=True)[0]
    if straddle.numel():
        rows, kth_rows = sim[straddle], kth[straddle]
        above = rows > kth_rows
        at = rows == kth_rows
        missing = k - above.sum(dim=1, keepdim=True)
        chosen = above | (at & (torch.cumsum(at, dim=1) <= missing))
        # Exactly k columns per row; nonzero() lists them row-major in increasing column order.
        fixed = chosen.nonzero(as_tuple=True)[1].view(straddle.numel(), k)
        fixed_vals = torch.gather(rows, 1, fixed)
        order = torch.sort(fixed_vals, dim=1, descending=True, stable=True).indices
        idx[straddle] = torch.gather(fixed, 1, order)
        vals[straddle] = torch.gather(fixed_vals, 1, order)
    return vals, idx


def knn_class_scores(
    train_features: Tensor,
    train_labels: Tensor,
    query_features: Tensor,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
) -> Tensor:
    """Weighted-vote class scores ``[Q, num_classes]`` of one block of queries (no chunking).

    Protocol of Wu et al. 2018 ("Unsupervised Feature Learning via Non-Parametric Instance
    Discrimination", Sec. 3.4), as used by DINO's ``eval_knn``, solo-learn and lightly: features
    are L2-normalised, each query's ``k`` most cosine-similar training samples vote for their label
    with weight ``exp(sim / temperature)``, and a class's score is the sum of its voters' weights.
    The default temperature 0.1 is lightly's ``knn_predict``'s (the MoCo CIFAR-10 demo's); DINO's
    ``eval_knn.py`` and solo-learn default to 0.07 (docs/evaluation.md says why sslkit keeps 0.1).

    For numerical safety each row is computed as ``exp((sim - sim_max) / temperature)`` where
    ``sim_max`` is the query's best similarity, so the returned scores equal the protocol's scores
    times a positive per-query factor ``exp(-sim_max / temperature)``: rankings and predictions are
    identical, and nothing overflows for small temperatures. ``k`` is clipped to the train size.
    Weights are added neighbour by neighbour (most similar first) rather than with an atomic
    scatter, so repeated runs give bit-identical scores on CPU and on CUDA.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = train_features.device
    train = F.normalize(train_features.float(), dim=1)
    query = F.normalize(query_features.to(device).float(), dim=1)
    labels = train_labels.to(device=device, dtype=torch.long)
    k = min(k, train.shape[0])

    sim = query @ train.T  # [Q, N_train], the only large intermediate
    top_sim, top_idx = select_neighbours(sim, k)
    best = top_sim.max(dim=1, keepdim=True).values
    weights = torch.exp((top_sim - best) / temperature)  # [Q, k], all in (0, 1]
    votes = labels[top_idx]  # [Q, k]
    scores = torch.zeros(query.shape[0], num_classes, device=device, dtype=weights.dtype)
    for j in range(k):  # one add per row per step: no colliding writes, a fixed summation order
        scores.scatter_add_(1, votes[:, j : j + 1], weights[:, j : j + 1])
    return scores


def weighted_knn(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
    chunk_size: int = 1024,
) -> dict[str, float]:
    """Top-1 (and top-5) accuracy of the weighted kNN classifier of Wu et al. 2018 (InstDisc).

    Each test feature is compared by cosine similarity with every training feature; its ``k``
    nearest neighbours (``k`` clipped to the train size) vote with weight ``exp(sim / temperature)``
    and the highest-scoring class is the prediction (see :func:`knn_class_scores`). The defaults
    ``k=200, temperature=0.1`` are InstDisc's (DINO reports k=20 as well). Features need not be
    normalised: both sides are L2-normalised here. Test queries are processed ``chunk_size`` at a
    time on ``train_features``' device, so memory is bounded by a ``chunk_size x N_train`` matrix;
    the chunk size does not change the result.

    Ties are deterministic: among neighbours with equal similarity at the k-th place the one with
    the lower train index is kept, and among classes with equal score the lower class index ranks
    first (a stable descending sort of the scores).

    Returns ``{"knn_top1": ..., "knn_top5": ...}`` as fractions in ``[0, 1]``; ``knn_top5`` is
    present only when ``num_classes >= 5``.
    """
    if train_features.ndim != 2 or test_features.ndim != 2:
        raise ValueError("features must be 2-D [N, D]")
    d_train, d_test = train_features.shape[1], test_features.shape[1]
    if d_train != d_test:
        raise ValueError(f"feature dims differ: train {d_train} vs test {d_test}")
    if train_features.shape[0] != train_labels.shape[0] or test_features.shape[0] != test_labels.shape[0]:
        raise ValueError("features and labels must have the same number of rows")
    if train_features.shape[0] == 0 or test_features.shape[0] == 0:
        raise ValueError("weighted_knn needs at least one train and one test sample")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if train_labels.min() < 0 or train_labels.max() >= num_classes:
        raise ValueError(f"train labels must lie in [0, {num_classes})")
    if not (torch.isfinite(train_features).all() and torch.isfinite(test_features).all()):
        raise ValueError("features contain NaN or inf")

    device = train_features.device
    top_n = min(5, num_classes)
    correct1 = torch.zeros((), dtype=torch.long, device=device)
    correct5 = torch.zeros((), dtype=torch.long, device=device)
    for start in range(0, test_features.shape[0], chunk_size):
        query = test_features[start : start + chunk_size]
        target = test_labels[start : start + chunk_size].to(device=device, dtype=torch.long)
        scores = knn_class_scores(train_features, train_labels, query, num_classes, k, temperature)
        ranked = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :top_n]
        hits = ranked == target[:, None]
        correct1 += hits[:, 0].sum()
        correct5 += hits.any(dim=1).sum()

    n = test_features.shape[0]
    result = {"knn_top1": correct1.item() / n}
    if num_classes >= 5:
        result["knn_top5"] = correct5.item() / n
    return result


def ranked_neighbours(sim: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` most similar columns of each row of ``sim``, ranked by decreasing similarity and, among equal
    similarities, by increasing column index: a total order, so the first ``j`` of the ``k`` are the deterministic
    top-``j`` of :func:`select_neighbours` for every ``j <= k`` (the kNN of several k and the retrieval ranks read
    one similarity pass). Returns ``(similarities, indices)``, both ``[Q, k]``."""
    vals, idx = select_neighbours(sim, k)
    by_index = torch.sort(idx, dim=1, stable=True)
    vals = torch.gather(vals, 1, by_index.indices)
    order = torch.sort(vals, dim=1, descending=True, stable=True).indices
    return torch.gather(vals, 1, order), torch.gather(by_index.values, 1, order)


def knn_predictions(train_features: Tensor, train_labels: Tensor, query_features: Tensor, num_classes: int,
                    ks: Sequence[int], temperature: float = 0.1, chunk_size: int = 1024) -> dict[int, Tensor]:
    """The weighted-kNN prediction ``[Q]`` (int64, on the CPU) of every query for each ``k`` of ``ks``, from one
    similarity pass: the largest ``k``'s neighbours are ranked once (:func:`ranked_neighbours`) and each smaller
    ``k`` reads their first ``k``. Each ``k`` gives exactly what :func:`weighted_knn` with that ``k`` predicts: the
    same neighbours (ties at the k-th place to the lower train index), the same votes added in the same order
    (most similar first, then lower index), ties between classes to the lower class index. ``k`` is clipped to the
    train size."""
    if not ks or min(ks) < 1:
        raise ValueError(f"ks must be a non-empty list of k >= 1, got {list(ks)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = train_features.device
    train = F.normalize(train_features.float(), dim=1)
    labels = train_labels.to(device=device, dtype=torch.long)
    top = min(max(ks), train.shape[0])
    out: dict[int, list[Tensor]] = {int(k): [] for k in ks}
    for start in range(0, query_features.shape[0], chunk_size):
        query = F.normalize(query_features[start : start + chunk_size].to(device).float(), dim=1)
        sims, idx = ranked_neighbours(query @ train.T, top)
        weights = torch.exp((sims - sims[:, :1]) / temperature)
        votes = labels[idx]
        scores = torch.zeros(query.shape[0], num_classes, device=device, dtype=weights.dtype)
        done = 0
        for k in sorted(out):
            for j in range(done, min(k, top)):
                scores.scatter_add_(1, votes[:, j : j + 1], weights[:, j : j + 1])
            done = min(k, top)
            out[k].append(torch.sort(scores, dim=1, descending=True, stable=True).indices[:, 0].cpu())
    return {k: torch.cat(v) if v else torch.zeros(0, dtype=torch.long) for k, v in out.items()}
