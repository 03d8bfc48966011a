"""The protocols of ``sslkit bench``, each a small function of one backbone's cached features: kNN, the linear
probe grid, few-shot logistic regression, retrieval, the attentive probe, dense segmentation, robustness to
corruptions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from sslkit.evaluation.attentive import AttentiveSettings, predict_attentive, train_attentive_grid
from sslkit.evaluation.dense import (
    LinearSegmentationHead,
    area_stats,
    dense_logits,
    dense_lr,
    image_area_stats,
    segmentation_metrics,
    train_dense_head,
)
from sslkit.evaluation.knn import knn_predictions
from sslkit.evaluation.probes import (
    GridSettings,
    fit_logistic,
    logistic_predict,
    row_space,
    shots_subset,
    stratified_split,
    train_probe_grid,
)
from sslkit.evaluation.retrieval import retrieval_scores
from sslkit.evaluation.stats import (
    bootstrap_interval,
    draws_summary,
    miou_statistic,
    per_class_mean,
    relative_statistic,
)

__all__ = ["PROTOCOLS", "Features", "Outcome", "choice_features", "primary_features"]


@dataclass
class Features:
    """One backbone's cached features of one split: ``pool`` ``[N, D]`` or, for a ViT, ``cls_last`` ``[N, n, D]``
    and ``avg`` ``[N, D]``; ``labels`` ``[N]``."""

    arrays: dict[str, np.ndarray]

    @property
    def keep(self) -> np.ndarray:
        """The rows of readable images (an unreadable one was cached with label -1)."""
        return np.asarray(self.arrays["labels"]) >= 0

    @property
    def unreadable(self) -> list[int]:
        """The dataset indices of the images that could not be read."""
        return np.nonzero(~self.keep)[0].tolist()

    def rows(self, name: str) -> np.ndarray:
        """Array ``name`` without the unreadable images' rows."""
        keep = self.keep
        return self.arrays[name] if keep.all() else np.asarray(self.arrays[name])[keep]

    @property
    def labels(self) -> Tensor:
        """int64 ``[N]`` of the readable images."""
        return torch.from_numpy(np.array(self.rows("labels"), dtype=np.int64))

    @property
    def is_vit(self) -> bool:
        """Cached from a ViT's tokens."""
        return "cls_last" in self.arrays


@dataclass
class Outcome:
    """What a protocol found for one backbone: ``metrics`` (name -> value, low, high, se: what the table shows),
    ``per_image`` (name -> the per-test-image values the intervals and the paired comparisons resample; not
    written), ``details`` (its settings and choices, written to the JSON)."""

    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    per_image: dict[str, Tensor] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


def _tensor(a: np.ndarray, device: torch.device) -> Tensor:
    return torch.from_numpy(np.array(a, dtype=np.float32)).to(device)  # a copy: the cache's arrays are read-only


def choice_features(f: Features, choice: str, device: torch.device) -> Tensor:
    """The features of one linear-probe choice: ``pool``; for a ViT ``cls`` (the last block's CLS token),
    ``cls+avg``, ``cls_last<n>`` (the last n blocks' CLS tokens, oldest first) and ``cls_last<n>+avg``."""
    if choice == "pool":
        return _tensor(f.rows("pool"), device)
    cls_last = _tensor(f.rows("cls_last"), device)
    if choice.startswith("cls_last"):
        n = int(choice[len("cls_last"):].split("+")[0])
        x = cls_last[:, -n:].reshape(cls_last.shape[0], -1)
    else:
        x = cls_last[:, -1]
    if choice.endswith("+avg"):
        x = torch.cat([x, _tensor(f.rows("avg"), device)], dim=1)
    return x


def primary_features(f: Features, device: torch.device) -> Tensor:
    """What kNN, few-shot, retrieval and robustness's kNN read: a ViT's last CLS token (DINO's kNN), else ``pool``."""
    return choice_features(f, "cls" if f.is_vit else "pool", device)


def linear_choices(f: Features) -> list[str]:
    """DINOv2's four feature choices for a ViT (``n_last_blocks`` 1 and 4, with and without the mean patch token),
    ``pool`` for the others."""
    if not f.is_vit:
        return ["pool"]
    n = int(f.arrays["cls_last"].shape[1])
    choices = ["cls", "cls+avg"]
    if n > 1:
        choices += [f"cls_last{n}", f"cls_last{n}+avg"]
    return choices


def _accuracy_metric(hits: Tensor, s: dict[str, Any]) -> dict[str, Any]:
    return bootstrap_interval(hits.double(), resamples=int(s["bootstrap"]), level=float(s["level"]),
                              seed=int(s["seed"]))


def knn(train: Features, test: Features, num_classes: int, s: dict[str, Any], device: torch.device) -> Outcome:
    """Weighted kNN (Wu et al. 2018; lightly's ``knn_predict``, T = 0.1 by default; DINO's ``eval_knn`` computes the
    same at T = 0.07: cosine similarity, votes ``exp(s / T)``) at every ``k`` of
    ``knn.ks`` from one similarity pass: top-1 per k, with its bootstrap interval over the test images."""
    ks = [int(k) for k in s["knn"]["ks"]]
    preds = knn_predictions(primary_features(train, device), train.labels.to(device), primary_features(test, device),
                            num_classes, ks, float(s["knn"]["temperature"]))
    out = Outcome(details={"ks": ks, "temperature": float(s["knn"]["temperature"]), "num_train": len(train.labels)})
    for k in ks:
        hits = (preds[k] == test.labels).double()
        out.per_image[f"knn_k{k}"] = hits
        out.metrics[f"knn_k{k}"] = _accuracy_metric(hits, s)
    return out


@dataclass
class LinearChoice:
    """The grid's classifier chosen on validation, with what it needs to score other test features: the feature
    choice, the standardisation the grid was trained on (the fit part's per-dimension mean and std; None: raw
    features), the weight ``[C, D]`` and bias ``[C]``."""

    choice: str
    weight: Tensor
    bias: Tensor
    mean: Tensor | None = None
    std: Tensor | None = None

    def logits(self, x: Tensor) -> Tensor:
        """Logits ``[N, C]`` of features ``x`` ``[N, D]`` (standardised as the grid's were)."""
        if self.mean is not None and self.std is not None:
            x = (x - self.mean.to(x.device)) / self.std.to(x.device)
        return x @ self.weight.T.to(x.device) + self.bias.to(x.device)


def linear_epochs(n_fit: int, s: dict[str, Any]) -> int:
    """The grid's passes over its ``n_fit`` images: ``linear.epochs``, raised until it takes ``linear.min_steps``
    SGD steps (2,000 images in batches of 256 make 8 steps a pass: 10 passes are 80 steps, far from converged)."""
    lin = s["linear"]
    per_epoch = -(-int(n_fit) // int(lin["batch_size"]))
    return max(int(lin["epochs"]), -(-int(lin.get("min_steps", 0)) // max(per_epoch, 1)))


def _grid_settings(s: dict[str, Any], lrs: list[float], n_fit: int) -> GridSettings:
    lin = s["linear"]
    return GridSettings(lrs=tuple(lrs), weight_decays=tuple(float(x) for x in lin["weight_decays"]),
                        epochs=linear_epochs(n_fit, s), batch_size=int(lin["batch_size"]), seed=int(s["seed"]))


def _standardised(x: Tensor, fit_idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``x`` with each dimension centred and scaled by the fit rows' mean and std (a constant dimension: by 1)."""
    rows = x[fit_idx]
    mean, std = rows.mean(0), rows.std(0)
    std = torch.where(std > 1e-12 * std.abs().max().clamp_min(1e-30), std, torch.ones_like(std))
    return (x - mean) / std, mean, std


def _score_grid(feats: dict[str, Tensor], labels: Tensor, fit_idx: Tensor, val_idx: Tensor, classes: int,
                settings: GridSettings, progress: Callable[[int], None] | None) -> list[tuple[float, str, float,
                                                                                        float, Tensor, Tensor]]:
    """Train one grid on the fit rows and score each classifier on the validation rows by mean per-class accuracy
    (DINOv2's metric): ``(score, choice, lr, weight decay, weight, bias)`` in grid order."""
    grid = train_probe_grid({c: v[fit_idx] for c, v in feats.items()}, labels[fit_idx], classes, settings, progress)
    rows = []
    with torch.no_grad():
        logits = grid({c: v[val_idx] for c, v in feats.items()})
        for c in feats:
            for cell, (lr, wd) in enumerate(grid.cells):
                pred = torch.sort(logits[c][cell], dim=1, descending=True, stable=True).indices[:, 0]
                score = per_class_mean((pred == labels[val_idx]).cpu(), labels[val_idx].cpu(), classes)
                rows.append((score, c, lr, wd, *grid.classifier(c, cell)))
    return rows


def _edge(lr: float, tried: list[float]) -> str | None:
    return "high" if lr >= max(tried) else "low" if lr <= min(tried) else None


def fit_linear(train: Features, num_classes: int, s: dict[str, Any], device: torch.device,
               progress: Callable[[int], None] | None = None) -> tuple[LinearChoice, dict[str, Any]]:
    """Train the grid (feature choices x lrs x weight decays, :func:`~sslkit.evaluation.probes.train_probe_grid`)
    on the train split less a stratified validation part (``linear.val_fraction``), score every classifier on the
    validation part by mean per-class accuracy (DINOv2's metric) and keep the best (the first of equals, in grid
    order). The test split is not seen. Two departures from DINOv2's ``eval/linear.py``, both named settings:
    ``linear.standardize`` (each feature dimension scaled by the fit part's mean and std, so that a backbone whose
    features are 25 times smaller meets the same lrs; DINOv2 trains on the raw features: false) and
    ``linear.min_steps`` (passes added until the grid takes that many steps; DINOv2 runs 12,500 on ImageNet). A
    choice at the grid's largest or smallest lr extends the grid past that edge (``linear.extend`` times, three
    lrs each: x2, x5, x10 or their inverses); still at an edge after that, it is flagged (``at_edge``)."""
    lin = s["linear"]
    labels = train.labels.to(device)
    fit_idx, val_idx = stratified_split(train.labels, float(lin["val_fraction"]), int(s["seed"]))
    fit_idx, val_idx = fit_idx.to(device), val_idx.to(device)
    feats = {c: choice_features(train, c, device) for c in linear_choices(train)}
    stats: dict[str, tuple[Tensor, Tensor]] = {}
    if bool(lin.get("standardize", False)):
        for c, x in list(feats.items()):
            feats[c], *pair = _standardised(x, fit_idx)
            stats[c] = (pair[0], pair[1])
    tried = [float(x) for x in lin["lrs"]]
    settings = _grid_settings(s, tried, int(fit_idx.numel()))
    rows = _score_grid(feats, labels, fit_idx, val_idx, num_classes, settings, progress)
    extended: list[float] = []
    for _ in range(int(lin.get("extend", 0))):
        edge = _edge(max(rows, key=lambda r: r[0])[2], tried)
        if edge is None:
            break
        new = [max(tried) * f for f in (2, 5, 10)] if edge == "high" else [min(tried) / f for f in (2, 5, 10)]
        rows += _score_grid(feats, labels, fit_idx, val_idx, num_classes, _grid_settings(s, new, len(fit_idx)),
                            progress)
        tried, extended = tried + new, extended + new
    score, choice, lr, wd, weight, bias = max(rows, key=lambda r: r[0])  # the first of equals
    mean, std = stats.get(choice, (None, None))
    details = {"chosen": {"features": choice, "lr": lr, "scaled_lr": settings.scaled(lr), "weight_decay": wd,
                          "val_mean_accuracy": round(score, 6)},
               "grid": [{"features": c, "lr": a, "weight_decay": d, "val_mean_accuracy": round(v, 6)}
                        for v, c, a, d, _, _ in rows],
               "num_fit": int(fit_idx.numel()), "num_val": int(val_idx.numel()), "epochs": settings.epochs,
               "steps": settings.epochs * -(-int(fit_idx.numel()) // settings.batch_size),
               "batch_size": settings.batch_size, "momentum": settings.momentum, "classifiers": len(rows),
               "standardize": bool(stats), "extended_lrs": extended, "at_edge": _edge(lr, tried)}
    return LinearChoice(choice, weight, bias, mean, std), details


def linear_hits(chosen: LinearChoice, test: Features, device: torch.device) -> Tensor:
    """0/1 per test image: the chosen classifier's top-1 (ties to the lower class) against the label."""
    logits = chosen.logits(choice_features(test, chosen.choice, device))
    pred = torch.sort(logits, dim=1, descending=True, stable=True).indices[:, 0]
    return (pred.cpu() == test.labels).double()


def linear(train: Features, test: Features, num_classes: int, s: dict[str, Any], device: torch.device,
           chosen: tuple[LinearChoice, dict[str, Any]]) -> Outcome:
    """The linear probe: the grid's classifier chosen on validation (:func:`fit_linear`), its test top-1."""
    hits = linear_hits(chosen[0], test, device)
    return Outcome({"linear": _accuracy_metric(hits, s)}, {"linear": hits}, chosen[1])


def _best_fit(x: Tensor, y: Tensor, val_x: Tensor, val_y: Tensor, classes: int, cs: list[float]
              ) -> tuple[float, Tensor, Tensor]:
    """DINOv3's choice of C (``eval/log_regression.py``, ``sweep_C_values``): the fit, for each C of ``cs``, that
    scores the best mean per-class accuracy on the validation images (the first of equals): ``(C, weight, bias)``.
    The features are brought to their row space once for every C (:func:`~sslkit.evaluation.probes.row_space`;
    starting each C from the fit of the one before took longer than from zero, measured)."""
    basis = row_space(x)
    z = x.double() if basis is None else x.double() @ basis
    best: tuple[float, float, Tensor, Tensor] | None = None
    for c in cs:
        w, b = fit_logistic(z, y, classes, c, reduce=False)
        w = w if basis is None else w @ basis.T
        score = per_class_mean(logistic_predict(w, b, val_x).cpu() == val_y, val_y, classes) if len(cs) > 1 else 0.0
        if best is None or score > best[0]:
            best = (score, c, w, b)
    assert best is not None
    return best[1], best[2], best[3]


def fewshot(train: Features, test: Features, num_classes: int, s: dict[str, Any], device: torch.device) -> Outcome:
    """Few-shot linear classification (LeJEPA's 1/10/all-shot protocol, DINOv3's ``eval/log_regression.py``): a
    stratified validation part of the train split is set aside (``fewshot.val_fraction``: DINOv3's 1 % for few-shot,
    10 % otherwise); for each ``shots`` (0: all the rest), ``draws`` seeded draws of that many of the other train
    images per class; on each, a multinomial L2-penalised logistic regression (scikit-learn's objective, L-BFGS) for
    every ``C`` of ``fewshot.cs``, the best on the validation part by mean per-class accuracy kept, then its test
    top-1; the mean and spread over draws (all-shot: one fit, its bootstrap interval). ``fewshot.normalize``: on
    L2-normalised features, so that one grid of C fits every backbone's scale (DINOv3 fits the raw features and
    sweeps 45 values of C from 1e-6 to 1e5, and refits all-shot on train + validation, which this does not)."""
    fs = s["fewshot"]
    norm = (lambda t: F.normalize(t, dim=1)) if fs["normalize"] else (lambda t: t)
    x_all = norm(primary_features(train, device))
    x_test = norm(primary_features(test, device))
    y_all = train.labels
    rest, val = stratified_split(y_all, float(fs["val_fraction"]), int(s["seed"]))
    val_x, val_y = x_all[val.to(device)], y_all[val]
    cs = [float(c) for c in fs["cs"]]
    out = Outcome(details={"cs": cs, "draws": int(fs["draws"]), "shots": list(fs["shots"]), "num_val": len(val),
                           "normalize": bool(fs["normalize"]), "chosen_c": {}})
    for shots in (int(v) for v in fs["shots"]):
        name = f"fewshot_{shots}" if shots else "fewshot_all"
        accs, hits, chosen = [], None, []
        for d in range(int(fs["draws"])) if shots else [0]:
            idx = rest[shots_subset(y_all[rest], shots, int(s["seed"]) * 1000 + d)] if shots else rest
            x, y = x_all[idx.to(device)], y_all[idx]
            c, w, b = _best_fit(x, y, val_x, val_y, num_classes, cs)
            hits = (logistic_predict(w, b, x_test).cpu() == test.labels).double()
            accs.append(float(hits.mean()))
            chosen.append(c)
        out.details["chosen_c"][name] = chosen
        if shots:
            out.metrics[name] = draws_summary(accs)
        else:
            assert hits is not None
            out.metrics[name] = _accuracy_metric(hits, s)
            out.per_image[name] = hits
    return out


def retrieval(train: Features, test: Features, num_classes: int, s: dict[str, Any], device: torch.device) -> Outcome:
    """Retrieval of the train split by the test split (:func:`~sslkit.evaluation.retrieval.retrieval_scores`):
    mAP@R and recall@k, each with its bootstrap interval over the queries."""
    ks = [int(k) for k in s["retrieval"]["ks"]]
    scores = retrieval_scores(primary_features(train, device), train.labels.to(device),
                              primary_features(test, device), test.labels.to(device), ks)
    out = Outcome(details={"ks": ks, "database": "train split", "queries": "test split"})
    for name, values in scores.items():
        out.per_image[name] = values
        out.metrics[name] = bootstrap_interval(values, resamples=int(s["bootstrap"]), level=float(s["level"]),
                                               seed=int(s["seed"]))
    return out


def robustness(train: Features, corrupted: dict[str, Features], clean: dict[str, Tensor], num_classes: int,
               s: dict[str, Any], device: torch.device, chosen: LinearChoice) -> Outcome:
    """kNN (``robustness.k``) and the chosen linear probe on the test split under each corruption and severity
    (``corrupted``: ``kind/severity`` -> features), relative to their clean accuracy (``clean``: each probe's 0/1
    hits on the clean test images): per corruption the mean over its severities, and ``robust_knn`` /
    ``robust_linear`` the mean over all (ImageNet-C's mean over corruptions and severities, here of accuracy
    relative to clean rather than the error relative to AlexNet's), with a bootstrap interval over the test images
    (each resample's corrupted and clean accuracies of the same images,
    :func:`~sslkit.evaluation.stats.relative_statistic`)."""
    k = int(s["robustness"]["k"])
    train_x = primary_features(train, device)
    out = Outcome(details={"k": k, "table": s["robustness"]["table"], "severities": list(s["robustness"]
                                                                                        ["severities"])})
    hits: dict[str, list[Tensor]] = {"knn": [clean["knn"].double()], "linear": [clean["linear"].double()]}
    per: dict[str, dict[str, list[float]]] = {"knn": {}, "linear": {}}
    for tag, feats in corrupted.items():
        kind = tag.split("/")[0]
        pred = knn_predictions(train_x, train.labels.to(device), primary_features(feats, device), num_classes, [k],
                               float(s["knn"]["temperature"]))[k]
        found = {"knn": (pred == feats.labels).double(), "linear": linear_hits(chosen, feats, device)}
        out.details[tag] = {probe: float(h.mean()) for probe, h in found.items()}
        for probe, h in found.items():
            hits[probe].append(h)
            per[probe].setdefault(kind, []).append(float(h.mean()) / max(float(hits[probe][0].mean()), 1e-12))
    out.details["clean"] = {probe: float(h[0].mean()) for probe, h in hits.items()}
    for probe, kinds in per.items():
        out.details[f"relative_{probe}"] = {kind: sum(v) / len(v) for kind, v in kinds.items()}
        values = torch.stack(hits[probe], dim=1)
        out.per_image[f"robust_{probe}"] = values
        out.metrics[f"robust_{probe}"] = bootstrap_interval(values, relative_statistic, resamples=int(s["bootstrap"]),
                                                            level=float(s["level"]), seed=int(s["seed"]))
    return out


def _kept_rows(f: Features) -> Tensor:
    """The dataset rows of the readable images, int64."""
    return torch.from_numpy(np.nonzero(f.keep)[0].astype(np.int64))


def attentive(train: Features, test: Features, num_classes: int, s: dict[str, Any], device: torch.device,
              num_heads: int, progress: Callable[[int], None] | None = None) -> Outcome:
    """The attentive probe (V-JEPA's, :class:`~sslkit.evaluation.attentive.AttentiveClassifier`) on the cached
    patch tokens (``tokens`` ``[N, n, D]``): a stratified validation part (``attentive.val_fraction``) set aside,
    one probe per (lr, weight decay) of the grid trained together on (the first ``attentive.train_samples`` of) the
    rest, the best on validation by mean per-class accuracy kept (the first of equals), its test top-1 with a
    bootstrap interval. V-JEPA augments the images of every epoch; on cached tokens nothing is augmented."""
    a = s["attentive"]
    heads = int(a["num_heads"] or num_heads)
    settings = AttentiveSettings(tuple(float(x) for x in a["lrs"]), tuple(float(x) for x in a["weight_decays"]),
                                 int(a["epochs"]), int(a["batch_size"]), heads, int(s["seed"]))
    rows, labels = _kept_rows(train), train.labels
    fit, val = stratified_split(labels, float(a["val_fraction"]), int(s["seed"]))
    if int(a["train_samples"]):
        fit = fit[: int(a["train_samples"])]
    tokens = train.arrays["tokens"]
    probes = train_attentive_grid(tokens, rows[fit], labels[fit], num_classes, settings, device, progress)
    val_pred = predict_attentive(probes, tokens, rows[val], device, settings.batch_size)
    scores = [per_class_mean(p == labels[val], labels[val], num_classes) for p in val_pred]
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    test_pred = predict_attentive([probes[best]], test.arrays["tokens"], _kept_rows(test), device,
                                  settings.batch_size)[0]
    hits = (test_pred == test.labels).double()
    lr, wd = settings.cells[best]
    details = {"chosen": {"lr": lr, "weight_decay": wd, "val_mean_accuracy": round(scores[best], 6)},
               "grid": [{"lr": c[0], "weight_decay": c[1], "val_mean_accuracy": round(v, 6)}
                        for c, v in zip(settings.cells, scores)],
               "num_fit": len(fit), "num_val": len(val), "epochs": settings.epochs,
               "batch_size": settings.batch_size, "num_heads": heads, "tokens": list(tokens.shape[1:]),
               "source": "V-JEPA's AttentiveClassifier (facebookresearch/jepa src/models/attentive_pooler.py) and "
                         "configs/evals/vitl16_in1k.yaml"}
    return Outcome({"attentive": _accuracy_metric(hits, s)}, {"attentive": hits}, details)


def dense(train: dict[str, np.ndarray], test: dict[str, np.ndarray], num_classes: int, s: dict[str, Any],
          device: torch.device, progress: Callable[[int], None] | None = None) -> Outcome:
    """The dense linear probe (``sslkit dense``'s protocol, DINOv3's linear segmentation) on cached patch maps
    (``maps`` ``[N, D, h, w]``, ``masks`` ``[N, H, W]``): the head (Dropout2d, BatchNorm, 1 x 1 conv, drawn from
    ``seed``) trained with ``eval.dense``'s AdamW, warm-up and cosine, its argmax scored by mIoU with a bootstrap
    interval over the test images (summed intersections over summed unions of each resample,
    :func:`~sslkit.evaluation.stats.miou_statistic`), pixel accuracy and per-class IoU."""
    d = s["dense"]
    maps, masks = train["maps"], train["masks"]
    torch.manual_seed(int(s["seed"]))
    head = LinearSegmentationHead(int(maps.shape[1]), num_classes, float(d["dropout"])).to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=float(d["lr"]), betas=(0.9, 0.999),
                            weight_decay=float(d["weight_decay"]))
    batch, epochs = int(d["batch_size"]), int(d["epochs"])
    total = -(-int(maps.shape[0]) // batch) * epochs
    warmup = min(int(d["warmup_steps"]), total // 10)
    losses = train_dense_head(maps, masks, head, opt, lambda t: dense_lr(float(d["lr"]), t, warmup, total), epochs,
                              batch, device, int(s["seed"]), progress)
    head.eval()
    per_image, summed = [], None
    with torch.no_grad():
        for start in range(0, int(test["maps"].shape[0]), batch):
            x = _tensor(test["maps"][start:start + batch], device)
            y = torch.from_numpy(np.array(test["masks"][start:start + batch], dtype=np.int64)).to(device)
            pred = dense_logits(head, x, tuple(y.shape[-2:])).argmax(1)
            per_image.append(image_area_stats(pred, y, num_classes).cpu())
            stats = area_stats(pred, y, num_classes)
            summed = stats if summed is None else summed + stats
    assert summed is not None
    values = torch.cat(per_image)
    metric = bootstrap_interval(values, miou_statistic, resamples=int(s["bootstrap"]), level=float(s["level"]),
                                seed=int(s["seed"]))
    details = {**segmentation_metrics(summed), "train_loss": [round(v, 6) for v in losses], "epochs": epochs,
               "batch_size": batch, "warmup_steps": warmup, "num_train": int(maps.shape[0]),
               "num_test": int(test["maps"].shape[0]), "feature_map": list(maps.shape[1:])}
    return Outcome({"dense_miou": metric}, {"dense_miou": values}, details)


#: The protocols by name: each reads one backbone's train and test features (attentive their patch tokens, dense the
#: segmentation set's patch maps; robustness also reads the corrupted test features).
PROTOCOLS: dict[str, Any] = {"knn": knn, "linear": linear, "fewshot": fewshot, "retrieval": retrieval,
                             "attentive": attentive, "dense": dense, "robustness": robustness}
