"""The linear probe: a linear classifier trained on a frozen encoder's features (the protocol SSL papers report)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LinearSettings", "accuracy", "cosine_lr", "make_classifier", "make_optimizer", "train_epoch",
           "warmup_cosine_lr"]


@dataclass(frozen=True)
class LinearSettings:
    """What the probe's result depends on besides the features (``eval.linear``)."""

    epochs: int = 90
    batch_size: int = 256
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 0.0

    @property
    def scaled_lr(self) -> float:
        """The peak learning rate: ``lr x batch_size / 256`` (the paper's linear scaling)."""
        return self.lr * self.batch_size / 256


def make_classifier(dim: int, num_classes: int, device: torch.device) -> nn.Linear:
    """``nn.Linear(dim, num_classes)`` with zero weights and bias (SimCLR's ``zero_init_logits_layer``): the probe
    starts from uniform predictions, and its result does not depend on an initialisation seed."""
    head = nn.Linear(dim, num_classes, device=device, dtype=torch.float32)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


def make_optimizer(head: nn.Module, s: LinearSettings) -> torch.optim.SGD:
    """SGD with (Nesterov) momentum and the scaled learning rate."""
    return torch.optim.SGD(head.parameters(), lr=s.scaled_lr, momentum=s.momentum,
                           nesterov=s.nesterov and s.momentum > 0, weight_decay=s.weight_decay)


def cosine_lr(base: float, step: int, total: int) -> float:
    """Cosine decay from ``base`` at step 0 to 0 at ``total`` (no warmup, as the protocol)."""
    return base * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


def warmup_cosine_lr(base: float, step: int, warmup: int, total: int, min_lr: float = 0.0,
                     start: float = 0.0) -> float:
    """Per step: linear from ``start`` to ``base`` over ``warmup`` steps, then a half cosine from ``base`` to ``min_lr``
    at ``total``. MAE's fine-tuning schedule (``util/lr_sched.py``: ``start`` 0) and DINOv3's linear segmentation
    probe's (``WarmupOneCycleLR`` with ``pct_start`` 0: ``start`` = ``base x 1e-6``, ``min_lr`` 0)."""
    if step < warmup:
        return start + (base - start) * step / warmup
    done = min(step - warmup, total - warmup) / max(total - warmup, 1)
    return min_lr + (base - min_lr) * 0.5 * (1.0 + math.cos(math.pi * done))


def feature_batches(features: Tensor, labels: Tensor, batch_size: int, generator: torch.Generator
                    ) -> Iterator[tuple[Tensor, Tensor]]:
    """Shuffled mini-batches of precomputed ``features`` / ``labels`` (the order drawn from ``generator`` on the
    CPU, so it does not depend on the device); the last, smaller batch is kept."""
    order = torch.randperm(features.shape[0], generator=generator).to(features.device)
    for start in range(0, features.shape[0], batch_size):
        idx = order[start : start + batch_size]
        yield features[idx], labels[idx]


def train_epoch(head: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[tuple[Tensor, Tensor]],
                lr_at: Callable[[int], float], first_step: int) -> tuple[float, int]:
    """One epoch of cross-entropy training of ``head`` on ``(features, labels)`` batches; the learning rate of
    step ``t`` is ``lr_at(t)``, counting from ``first_step``. Returns the mean loss (one host sync, at the end)
    and the next step."""
    head.train()
    total = torch.zeros((), dtype=torch.float64, device=next(head.parameters()).device)
    seen = 0
    step = first_step
    for feats, labels in batches:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = F.cross_entropy(head(feats.float()), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += loss.detach().double() * labels.shape[0]
        seen += labels.shape[0]
        step += 1
    return (total.item() / max(seen, 1)), step


@torch.no_grad()
def accuracy(head: nn.Module, features: Tensor, labels: Tensor, num_classes: int, chunk: int = 8192
             ) -> dict[str, float]:
    """Top-1 and (with 5 classes or more) top-5 accuracy of ``head`` on ``features``; ties between classes go to
    the lower class index (a stable sort), as in :func:`~sslkit.evaluation.knn.weighted_knn`."""
    head.eval()
    top_n = min(5, num_classes)
    hits1 = torch.zeros((), dtype=torch.long, device=features.device)
    hits5 = torch.zeros((), dtype=torch.long, device=features.device)
    for start in range(0, features.shape[0], chunk):
        logits = head(features[start : start + chunk].float())
        target = labels[start : start + chunk]
        ranked = torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :top_n]
        hit = ranked == target[:, None]
        hits1 += hit[:, 0].sum()
        hits5 += hit.any(dim=1).sum()
    n = max(features.shape[0], 1)
    result = {"top1": hits1.item() / n}
    if num_classes >= 5:
        result["top5"] = hits5.item() / n
    return result


def settings_of(section: Any) -> LinearSettings:
    """:class:`LinearSettings` from the ``eval.linear`` config section."""
    return LinearSettings(epochs=int(section.epochs), batch_size=int(section.batch_size), lr=float(section.lr),
                          momentum=float(section.momentum), nesterov=bool(section.nesterov),
                          weight_decay=float(section.weight_decay))
