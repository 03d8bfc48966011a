"""Retrieval of the train split's images by the test split's: mAP@R and recall@k per query."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from sslkit.evaluation.knn import ranked_neighbours

__all__ = ["retrieval_scores"]

#: Similarities held at once: the query chunk is sized so that ``chunk x max R`` stays below this.
_BUDGET = 1 << 24


def retrieval_scores(train_features: Tensor, train_labels: Tensor, query_features: Tensor, query_labels: Tensor,
                     ks: Sequence[int] = (1, 5, 10)) -> dict[str, Tensor]:
    """Per query (float64 ``[Q]`` on the CPU): ``map_at_r`` and ``recall_at_<k>`` for each ``k`` of ``ks``, the
    database being the train split, ranked by cosine similarity (ties to the lower train index,
    :func:`~sslkit.evaluation.knn.ranked_neighbours`).

    * mAP@R (Musgrave, Belongie and Lim, "A Metric Learning Reality Check", ECCV 2020, Sec. 3.2): with ``R`` the
      number of train images of the query's label, ``AP@R = (1/R) sum_{i=1..R} P(i) rel(i)``, ``rel(i)`` 1 when the
      i-th retrieved image has the query's label and ``P(i)`` the precision of the first ``i``. A query whose label
      no train image has scores 0.
    * recall@k as the metric-learning papers report it (Song et al. 2016, and Musgrave et al.'s "R@1"): 1 when at
      least one of the first ``k`` retrieved images has the query's label, else 0.

    The means over queries are the figures; the per-query values give their bootstrap interval."""
    device = train_features.device
    train = F.normalize(train_features.float(), dim=1)
    labels = train_labels.to(device=device, dtype=torch.long)
    query_labels = query_labels.to(device=device, dtype=torch.long)
    n_classes = int(max(int(labels.max()), int(query_labels.max()))) + 1
    per_label = torch.bincount(labels, minlength=n_classes)
    r_max = int(per_label[query_labels].max()) if query_labels.numel() else 0
    depth = min(max(r_max, max(ks)), train.shape[0])
    chunk = max(1, _BUDGET // max(depth, train.shape[0] // 8, 1))
    ap: list[Tensor] = []
    recall: dict[int, list[Tensor]] = {int(k): [] for k in ks}
    for start in range(0, query_features.shape[0], chunk):
        query = F.normalize(query_features[start : start + chunk].to(device).float(), dim=1)
        target = query_labels[start : start + chunk]
        _, idx = ranked_neighbours(query @ train.T, depth)
        rel = (labels[idx] == target[:, None]).double()  # [q, depth]
        r = per_label[target].double()  # [q]
        ranks = torch.arange(1, depth + 1, device=device, dtype=torch.float64)
        precision = rel.cumsum(dim=1) / ranks
        within = ranks[None, :] <= r[:, None]
        ap.append(((precision * rel * within).sum(dim=1) / r.clamp(min=1)).cpu())
        for k in recall:
            recall[k].append((rel[:, : min(k, depth)].sum(dim=1) > 0).double().cpu())
    out = {"map_at_r": torch.cat(ap) if ap else torch.zeros(0, dtype=torch.float64)}
    out.update({f"recall_at_{k}": torch.cat(v) if v else torch.zeros(0, dtype=torch.float64)
                for k, v in recall.items()})
    return out
