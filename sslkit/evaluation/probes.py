"""Probes on cached features: a grid of linear classifiers trained together (DINOv2's linear evaluation), the split
that picks among them, and multinomial logistic regression (the few-shot protocol)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from sslkit.evaluation.linear import cosine_lr

__all__ = ["DINOV2_LRS", "GridSettings", "LinearProbeGrid", "fit_logistic", "logistic_predict", "row_space",
           "shots_subset", "stratified_split", "train_probe_grid"]

#: DINOv2's learning rates (``dinov2/eval/linear.py``: ``--learning-rates``), before the ``batch / 256`` scaling.
DINOV2_LRS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)


@dataclass(frozen=True)
class GridSettings:
    """What the grid's result depends on besides the features: DINOv2's linear evaluation (SGD, momentum 0.9,
    cosine annealing to 0 per step, classifier weights from N(0, 0.01), bias 0), with weight decay as a second
    axis of the grid (DINOv2 fixes it at 0)."""

    lrs: tuple[float, ...] = DINOV2_LRS
    weight_decays: tuple[float, ...] = (0.0, 1e-4)
    epochs: int = 10
    batch_size: int = 256
    momentum: float = 0.9
    init_std: float = 0.01
    seed: int = 0
    #: the lr of a classifier is ``lr x batch_size / 256`` (DINOv2's ``scale_lr``)
    scale_lr: bool = True

    def scaled(self, lr: float) -> float:
        """The peak learning rate a grid value ``lr`` trains with."""
        return lr * self.batch_size / 256 if self.scale_lr else lr


class LinearProbeGrid(torch.nn.Module):
    """Every (feature choice, learning rate, weight decay) linear classifier of a grid as one module: per feature
    choice one weight ``[D, G x C]`` and bias ``[G x C]`` for its ``G = len(lrs) x len(weight_decays)``
    classifiers side by side (classifier ``g``'s columns ``g C`` to ``g C + C - 1``), so a batch is one matrix
    product per choice and one update for all (DINOv2's ``AllClassifiers``, whose classifiers are separate modules,
    trained on the same batches with one optimizer). Every classifier of a choice starts from the same weights, drawn
    from N(0, ``init_std``) by ``seed``: a probe trained alone from that seed starts where its twin in the grid
    does."""

    def __init__(self, dims: Mapping[str, int], num_classes: int, settings: GridSettings,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.settings, self.num_classes = settings, int(num_classes)
        self.choices = list(dims)
        self.cells = [(lr, wd) for lr in settings.lrs for wd in settings.weight_decays]
        g = len(self.cells)
        self.weight = torch.nn.ParameterDict()
        self.bias = torch.nn.ParameterDict()
        for name, dim in dims.items():
            gen = torch.Generator().manual_seed(int(settings.seed))
            w = torch.randn(num_classes, dim, generator=gen, dtype=torch.float32) * settings.init_std
            self.weight[_key(name)] = torch.nn.Parameter(w.T.repeat(1, g).contiguous().to(device))
            self.bias[_key(name)] = torch.nn.Parameter(torch.zeros(g * num_classes, device=device))
        lr = torch.tensor([settings.scaled(c[0]) for c in self.cells], dtype=torch.float32, device=device)
        wd = torch.tensor([c[1] for c in self.cells], dtype=torch.float32, device=device)
        self.register_buffer("base_lr", lr, persistent=False)
        self.register_buffer("decay", wd, persistent=False)
        # the same per column of a weight [D, G C] (classifier g's lr and decay on its C columns)
        self.register_buffer("column_lr", lr.repeat_interleave(num_classes), persistent=False)
        self.register_buffer("column_decay", wd.repeat_interleave(num_classes), persistent=False)

    def forward(self, features: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Logits ``[G, B, C]`` of every classifier of each feature choice, from ``features[choice]`` ``[B, D]``."""
        out = {}
        for name in self.choices:
            logits = torch.addmm(self.bias[_key(name)], features[name].float(), self.weight[_key(name)])
            out[name] = logits.view(-1, len(self.cells), self.num_classes).transpose(0, 1)
        return out

    def classifier(self, choice: str, cell: int) -> tuple[Tensor, Tensor]:
        """The weight ``[C, D]`` and bias ``[C]`` of one classifier, as an ``nn.Linear`` holds them."""
        cols = slice(cell * self.num_classes, (cell + 1) * self.num_classes)
        return self.weight[_key(choice)][:, cols].T.detach(), self.bias[_key(choice)][cols].detach()


def _key(name: str) -> str:
    return name.replace(".", "_").replace("+", "_plus_")


#: Probabilities taken as 0 in the written-out gradients (:func:`_softmax_residual`), by dtype: above the range
#: where they or their quotient by a batch size become subnormal.
_NEGLIGIBLE = {torch.float32: 1e-30, torch.float64: 1e-300}


def _softmax_residual(logits: Tensor, one_hot: Tensor, count: int) -> Tensor:
    """``(softmax(logits) - one_hot) / count`` over the last dimension, written over ``logits``: the gradient of a
    mean cross-entropy with respect to its logits. The softmax is written out (torch's over a last dimension of
    C = 10 took five times as long), and probabilities below :data:`_NEGLIGIBLE` are taken as 0: a confident
    classifier's smallest ones fall below the dtype's normal range, and a matrix product over subnormal numbers
    runs a hundred times slower on a CPU (the grid took 34 s instead of 9 on real pixels' features). The one-hot
    is subtracted, not scattered: the same sums on every device, deterministic mode or not."""
    probs = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    probs.div_(probs.sum(dim=-1, keepdim=True))
    probs.masked_fill_(probs < _NEGLIGIBLE.get(probs.dtype, 1e-30), 0.0)
    return probs.sub_(one_hot).div_(count)


def _gradients(grid: LinearProbeGrid, x: Tensor, y: Tensor, name: str) -> tuple[Tensor, Tensor]:
    """Each classifier's gradient of its own mean cross-entropy on the batch ``x`` ``[B, D]``, labels ``y``, written
    out (``(softmax - one-hot) / B``, then ``x^T`` times it): the weight's ``[D, G C]`` and the bias's ``[G C]``."""
    b, g, c = x.shape[0], len(grid.cells), grid.num_classes
    with torch.no_grad():
        logits = torch.addmm(grid.bias[_key(name)], x, grid.weight[_key(name)]).view(b, g, c)
        delta = _softmax_residual(logits, F.one_hot(y, c).to(logits.dtype)[:, None, :], b).view(b, g * c)
        return x.T @ delta, delta.sum(0)


def _sgd_step(grid: LinearProbeGrid, name: str, grads: tuple[Tensor, Tensor], buffers: dict[str, Tensor],
              scale: float) -> None:
    """``torch.optim.SGD``'s update (momentum, no dampening, no Nesterov: ``d = g + wd p``, ``buf = m buf + d``,
    ``p -= lr buf``) of every classifier of one feature choice at once, each with its own lr (``base_lr x scale``)
    and weight decay."""
    m, decay, rate = grid.settings.momentum, grid.column_decay, grid.column_lr * scale
    with torch.no_grad():
        for part, p, grad in (("weight", grid.weight[_key(name)], grads[0]), ("bias", grid.bias[_key(name)], grads[1])):
            d = torch.addcmul(grad, p, decay)
            key = f"{name}/{part}"
            if m:
                if key not in buffers:  # torch's SGD: the first step's buffer is the gradient itself
                    buffers[key] = d
                else:
                    buffers[key].mul_(m).add_(d)
                d = buffers[key]
            p.addcmul_(d, rate, value=-1.0)


def _batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[Tensor]:
    order = torch.randperm(n, generator=generator)
    for start in range(0, n, batch_size):
        yield order[start : start + batch_size]


def row_space(x: Tensor) -> Tensor | None:
    """An orthonormal basis ``V`` ``[D, N]`` (float64) of a space holding the row space of ``x`` ``[N, D]`` when it
    has fewer rows than dimensions (None otherwise: nothing to gain): ``Q`` of the QR factorisation of ``x^T``. A
    linear classifier's gradients on these rows all lie in that space, so training on ``x @ V`` (``N``
    dimensions) and mapping back is the same training in fewer dimensions: 2,000 images of a 4,096-wide backbone
    train in under half the arithmetic."""
    n, d = x.shape
    if n >= d:
        return None
    return torch.linalg.qr(x.double().T, mode="reduced").Q


def _orthogonal_decay(grid: LinearProbeGrid, scalars: dict[str, Tensor], scale: float) -> None:
    """The part of each classifier's start outside the features' row space gets no gradient, only weight decay
    through SGD's momentum: it stays ``a x`` that start, with ``a`` (and its momentum ``b``) ``[G]`` updated here as
    :func:`_sgd_step` updates the weights."""
    m, d = grid.settings.momentum, grid.decay.double() * scalars["a"]
    scalars["b"] = d if "b" not in scalars or not m else scalars["b"] * m + d
    scalars["a"] = scalars["a"] - scalars["b"] * (grid.base_lr.double() * scale)


def _train(grid: LinearProbeGrid, inputs: Mapping[str, Tensor], labels: Tensor, settings: GridSettings,
           scalars: dict[str, Tensor], progress: Callable[[int], None] | None) -> None:
    """The grid's passes: each over one shuffled order (drawn on the CPU from ``seed`` and the epoch) in batches,
    the last one kept, with the lr's cosine from the peak to 0 over all steps; ``scalars`` carries
    :func:`_orthogonal_decay`'s factor out."""
    buffers: dict[str, Tensor] = {}  # SGD's momentum per choice and part
    n = labels.shape[0]
    total = -(-n // settings.batch_size) * settings.epochs
    step = 0
    for epoch in range(settings.epochs):
        g = torch.Generator().manual_seed(int(settings.seed) * 100_003 + epoch)
        for idx in _batches(n, settings.batch_size, g):
            idx = idx.to(labels.device)
            y = labels[idx]
            scale = cosine_lr(1.0, step, total)
            for k, v in inputs.items():
                _sgd_step(grid, k, _gradients(grid, v[idx], y, k), buffers, scale)
            _orthogonal_decay(grid, scalars, scale)
            step += 1
            if progress is not None:
                progress(1)


def train_probe_grid(features: Mapping[str, Tensor], labels: Tensor, num_classes: int, settings: GridSettings,
                     progress: Callable[[int], None] | None = None, reduce: bool = True) -> LinearProbeGrid:
    """Train every classifier of the grid together on the cached ``features`` (``{choice: [N, D]}``, one row per
    image, on the device they will train on) and ``labels`` ``[N]``: ``epochs`` passes, each over one shuffled
    order (drawn on the CPU from ``seed`` and the epoch) in batches of ``batch_size``, the last one kept; the loss
    of each classifier is its own mean cross-entropy, so the summed loss gives each its own gradient. The lr
    follows a cosine from the peak to 0 over all steps (DINOv2: ``CosineAnnealingLR(max_iter, eta_min=0)``).
    A choice with fewer images than dimensions trains in its images' row space (:func:`row_space`) and is mapped
    back (``reduce``): the same classifiers, to float rounding. ``progress(steps)`` is told after every batch."""
    device = labels.device
    full = LinearProbeGrid({k: v.shape[1] for k, v in features.items()}, num_classes, settings, device)
    bases = {k: row_space(v) if reduce else None for k, v in features.items()}
    inputs = {k: v if bases[k] is None else (v.double() @ bases[k]).float() for k, v in features.items()}
    grid = LinearProbeGrid({k: v.shape[1] for k, v in inputs.items()}, num_classes, settings, device)
    with torch.no_grad():
        for k, basis in bases.items():
            start = full.weight[_key(k)]
            grid.weight[_key(k)].copy_(start if basis is None else (basis.T @ start.double()).float())
    scalars = {"a": torch.ones(len(grid.cells), dtype=torch.float64, device=device)}
    _train(grid, inputs, labels, settings, scalars, progress)
    with torch.no_grad():
        for k, basis in bases.items():
            full.bias[_key(k)].copy_(grid.bias[_key(k)])
            if basis is None:
                full.weight[_key(k)].copy_(grid.weight[_key(k)])
                continue
            start = full.weight[_key(k)].double()
            outside = start - basis @ (basis.T @ start)
            inside = basis @ grid.weight[_key(k)].double()
            full.weight[_key(k)].copy_((inside + scalars["a"].repeat_interleave(num_classes) * outside).float())
    return full


def stratified_split(labels: Tensor, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Indices ``(train, validation)`` of a seeded split that puts ``round(fraction x n_c)`` images of each class
    ``c`` (at least one when the class has two or more) in the validation part: what the grid is chosen on, never
    the test split. Both sorted."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the validation fraction must be in (0, 1), got {fraction}")
    g = torch.Generator().manual_seed(int(seed))
    labels = labels.cpu().long()
    val: list[Tensor] = []
    for c in torch.unique(labels).tolist():
        members = (labels == c).nonzero(as_tuple=True)[0]
        take = round(fraction * members.numel())
        if members.numel() >= 2:
            take = min(max(take, 1), members.numel() - 1)
        else:
            take = 0
        val.append(members[torch.randperm(members.numel(), generator=g)[:take]])
    v = torch.sort(torch.cat(val)).values if val else torch.zeros(0, dtype=torch.long)
    keep = torch.ones(labels.numel(), dtype=torch.bool)
    keep[v] = False
    return keep.nonzero(as_tuple=True)[0], v


def shots_subset(labels: Tensor, shots: int, seed: int) -> Tensor:
    """Sorted indices of ``shots`` images of each class drawn by ``seed`` (all of a class that has fewer)."""
    g = torch.Generator().manual_seed(int(seed))
    labels = labels.cpu().long()
    picked = []
    for c in torch.unique(labels).tolist():
        members = (labels == c).nonzero(as_tuple=True)[0]
        picked.append(members[torch.randperm(members.numel(), generator=g)[:shots]])
    return torch.sort(torch.cat(picked)).values


_FTOL = 64 * torch.finfo(torch.float64).eps  # scikit-learn's L-BFGS ftol in _logistic_regression_path


def fit_logistic(features: Tensor, labels: Tensor, num_classes: int, c: float = 1.0, max_iter: int = 1000,
                 tol: float = 1e-6, reduce: bool = True) -> tuple[Tensor, Tensor]:
    """Multinomial logistic regression with an L2 penalty, scikit-learn's ``LogisticRegression(C=c)`` objective
    (``0.5 ||W||^2 + C sum_i CE_i``, the intercept not penalised), minimised in float64 by L-BFGS with a strong
    Wolfe line search from zero weights until the gradient's largest entry is below ``tol`` (scaled by the sample
    count) or a step changes the objective by less than scikit-learn's ``ftol`` (64 float64 epsilons: with 1e-12,
    ill-conditioned fits stopped with gradients 200x the tolerance; measured). With fewer images than dimensions it
    is fitted in their row space (:func:`row_space`: the solution and L-BFGS's path from zero lie there) and mapped
    back (``reduce``). Returns ``(weight [C, D], bias [C])`` in float64 on the features' device."""
    basis = row_space(features) if reduce else None
    x = features.double() if basis is None else features.double() @ basis
    y = labels.to(x.device).long()
    n, d = x.shape
    w = torch.zeros(num_classes, d, dtype=torch.float64, device=x.device, requires_grad=True)
    b = torch.zeros(num_classes, dtype=torch.float64, device=x.device, requires_grad=True)
    scale = 1.0 / (c * n)  # the objective divided by C n: the same minimum, gradients of order 1

    one_hot = F.one_hot(y, num_classes).to(x.dtype)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, tolerance_grad=tol * scale, tolerance_change=_FTOL,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        """The mean cross-entropy plus the penalty, its gradients written out (``(softmax - one-hot) / N`` times
        ``x``, plus ``scale w``): autograd's bookkeeping was half of each evaluation at these sizes. The softmax is
        ``exp(shifted - lse)``, not :func:`_softmax_residual`'s quotient: L-BFGS's stopping point moves with its
        rounding, and the row-space test holds the reduced fit to the direct one within 1e-9."""
        with torch.no_grad():
            logits = torch.addmm(b, x, w.T)
            shifted = logits - logits.amax(dim=1, keepdim=True)
            lse = shifted.exp().sum(dim=1, keepdim=True).log()
            loss = (lse - (shifted * one_hot).sum(dim=1, keepdim=True)).mean() + 0.5 * scale * (w * w).sum()
            delta = (shifted - lse).exp_()
            # as in the grid's gradients: probabilities too small to matter are 0, not subnormal (slow on a CPU)
            delta.masked_fill_(delta < _NEGLIGIBLE[torch.float64], 0.0).sub_(one_hot).div_(n)
            w.grad = torch.addmm(w, delta.T, x, beta=scale)
            b.grad = delta.sum(0)
        return loss

    opt.step(closure)
    return (w.detach() if basis is None else w.detach() @ basis.T), b.detach()


def logistic_predict(weight: Tensor, bias: Tensor, features: Tensor) -> Tensor:
    """The predicted class ``[N]`` (ties to the lower class index)."""
    logits = features.to(weight.device).double() @ weight.T + bias
    return torch.sort(logits, dim=1, descending=True, stable=True).indices[:, 0]
