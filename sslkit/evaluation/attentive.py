"""The attentive probe: one learned query cross-attending to a frozen ViT's patch tokens, then a linear classifier
(V-JEPA's ``AttentiveClassifier``, facebookresearch/jepa ``src/models/attentive_pooler.py``), a grid of them trained
together on cached tokens."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["AttentiveClassifier", "AttentiveSettings", "attentive_lr", "predict_attentive", "train_attentive_grid"]


class AttentiveClassifier(nn.Module):
    """V-JEPA's attentive classifier with its defaults (``num_queries=1``, ``depth=1``, ``complete_block=True``,
    ``qkv_bias=True``, ``mlp_ratio=4``): a query token ``[1, 1, D]`` that cross-attends to the LayerNormed tokens
    (``q`` and ``kv`` projections, scaled dot-product attention over ``num_heads`` heads, an output projection),
    added to the query, then the query plus an MLP (GELU) of its LayerNorm, then ``nn.Linear(D, classes)``. As in
    the reference's code: the query and every linear layer of the pooler drawn from a normal of std ``init_std``
    truncated at +-2 (absolute, timm's ``trunc_normal_``), biases 0, LayerNorms 1 and 0, the attention's output
    projection and the MLP's second layer divided by sqrt(2); the classifier keeps PyTorch's own init. The tokens
    carry their own positions (the encoder added them): the pooler adds none."""

    def __init__(self, dim: int, num_classes: int, num_heads: int = 1, mlp_ratio: float = 4.0,
                 init_std: float = 0.02) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"the attentive probe's {num_heads} heads must divide the token width {dim}")
        self.num_heads = int(num_heads)
        self.query = nn.Parameter(torch.zeros(1, 1, dim))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.kv, self.proj = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        hidden = int(dim * mlp_ratio)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        nn.init.trunc_normal_(self.query, std=init_std)
        for m in (self.q, self.kv, self.proj, self.fc1, self.fc2):
            nn.init.trunc_normal_(m.weight, std=init_std)
            nn.init.zeros_(m.bias)
        with torch.no_grad():
            self.proj.weight.div_(math.sqrt(2.0))
            self.fc2.weight.div_(math.sqrt(2.0))
        self.linear = nn.Linear(dim, num_classes)

    def pool(self, tokens: Tensor) -> Tensor:
        """The pooled feature ``[B, D]`` of tokens ``[B, N, D]``."""
        b, n, d = tokens.shape
        h = self.num_heads
        q = self.q(self.query.expand(b, -1, -1)).reshape(b, 1, h, d // h).transpose(1, 2)
        k, v = self.kv(self.norm1(tokens)).reshape(b, n, 2, h, d // h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, 1, d)
        x = self.query + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return x[:, 0]

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``[B, classes]`` of tokens ``[B, N, D]``."""
        return self.linear(self.pool(tokens))


@dataclass(frozen=True)
class AttentiveSettings:
    """How the attentive probes train: V-JEPA's ``configs/evals/vitl16_in1k.yaml`` by default (AdamW, lr 1e-3 with
    no warm-up and a cosine to 0, weight decay 1e-3 on the weights (not on biases and 1-d parameters), 20 epochs,
    a global batch of 1024 = 16 x 64 GPUs), one probe per (lr, weight decay) of the grid."""

    lrs: tuple[float, ...] = (1e-3,)
    weight_decays: tuple[float, ...] = (1e-3,)
    epochs: int = 20
    batch_size: int = 1024
    num_heads: int = 1
    seed: int = 0

    @property
    def cells(self) -> list[tuple[float, float]]:
        """The grid, lr-major: ``(lr, weight_decay)`` per probe."""
        return [(lr, wd) for lr in self.lrs for wd in self.weight_decays]


def attentive_lr(base: float, step: int, total: int) -> float:
    """V-JEPA's ``WarmupCosineSchedule`` without warm-up and with ``final_lr`` 0: ``base x (1 + cos(pi t / T)) / 2``."""
    return base * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


def _optimizer(probe: nn.Module, lr: float, wd: float) -> torch.optim.Optimizer:
    decay = [p for n, p in probe.named_parameters() if "bias" not in n and p.ndim != 1]
    rest = [p for n, p in probe.named_parameters() if "bias" in n or p.ndim == 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}], lr=lr)


def _rows(tokens: np.ndarray, index: Tensor, device: torch.device) -> Tensor:
    """Rows ``index`` of a (memory-mapped, float16) token array as float32 on ``device``."""
    return torch.from_numpy(np.asarray(tokens[np.sort(index.numpy())], dtype=np.float32)).to(device)


def train_attentive_grid(tokens: np.ndarray, rows: Tensor, labels: Tensor, num_classes: int,
                         settings: AttentiveSettings, device: torch.device,
                         progress: Callable[[int], None] | None = None) -> list[AttentiveClassifier]:
    """One :class:`AttentiveClassifier` per grid cell, trained together: every probe starts from the same draw
    (``settings.seed``) and steps on the same batches (a seeded shuffle of ``rows`` of ``tokens`` ``[N, n, D]`` each
    epoch, the last batch smaller), with its own AdamW (:func:`attentive_lr`), so each ends as it would trained
    alone. ``labels`` ``[len(rows)]`` are the classes of ``rows``. ``progress(1)`` after every step."""
    dim = int(tokens.shape[-1])
    probes, optimizers = [], []
    for lr, wd in settings.cells:
        torch.manual_seed(settings.seed)
        probe = AttentiveClassifier(dim, num_classes, settings.num_heads).to(device)
        probes.append(probe)
        optimizers.append(_optimizer(probe, lr, wd))
    g = torch.Generator().manual_seed(settings.seed)
    steps = -(-len(rows) // settings.batch_size) * settings.epochs
    step = 0
    for _ in range(settings.epochs):
        order = torch.randperm(len(rows), generator=g)
        for start in range(0, len(rows), settings.batch_size):
            pick = order[start:start + settings.batch_size]
            sel = rows[pick]
            x = _rows(tokens, sel, device)
            y = labels[pick][torch.argsort(sel)].to(device)  # the rows come back sorted by index
            for probe, opt, (lr, _) in zip(probes, optimizers, settings.cells):
                for group in opt.param_groups:
                    group["lr"] = attentive_lr(lr, step, steps)
                loss = F.cross_entropy(probe(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            step += 1
            if progress is not None:
                progress(1)
    return probes


@torch.no_grad()
def predict_attentive(probes: Sequence[nn.Module], tokens: np.ndarray, rows: Tensor, device: torch.device,
                      batch_size: int = 1024) -> Tensor:
    """``[G, len(rows)]`` top-1 (ties to the lower class) of each probe on ``rows`` of ``tokens``, in ``rows``'
    order."""
    out = []
    for start in range(0, len(rows), batch_size):
        sel = rows[start:start + batch_size]
        x = _rows(tokens, sel, device)
        back = torch.argsort(torch.argsort(sel))  # sorted rows back to the order asked
        preds = [torch.sort(p.eval()(x), dim=1, descending=True, stable=True).indices[:, 0][back.to(device)]
                 for p in probes]
        out.append(torch.stack(preds).cpu())
    return torch.cat(out, dim=1) if out else torch.zeros(len(probes), 0, dtype=torch.long)
