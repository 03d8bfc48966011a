"""The results of ``sslkit bench``: which differences the spread supports, and the table as Markdown, CSV, JSON and a
picture; ``sslkit bench compare`` lines up earlier results folders."""

from __future__ import annotations

import csv
import io
import json
import math
import os
from typing import Any

from torch import Tensor

from sslkit.evaluation.stats import Statistic, miou_statistic, paired_difference, relative_statistic
from sslkit.files import atomic_write

__all__ = ["compare_folders", "comparisons", "markdown_table", "write_results"]

#: What each metric is, for the table's legend.
LEGEND = {
    "knn_k": "weighted kNN top-1 at k",
    "linear": "linear probe top-1 (the grid's best on validation)",
    "fewshot_all": "logistic regression top-1 on the whole train split (less its validation part)",
    "fewshot_": "logistic regression top-1 with n images per class (mean of draws)",
    "map_at_r": "retrieval mAP@R",
    "recall_at_": "retrieval recall@k",
    "attentive": "attentive probe top-1 (V-JEPA's: one query cross-attending to the patch tokens; the grid's best on "
                 "validation)",
    "dense_miou": "dense linear segmentation mIoU (DINOv3's linear head on the patch tokens; eval.dense's set)",
    "robust_": "accuracy under corruptions relative to clean (mean over corruptions and severities)",
}
#: The statistic of a metric whose per-image values are not 0/1 hits or scores to average.
STATISTICS: dict[str, Statistic] = {"dense_miou": miou_statistic, "robust_knn": relative_statistic,
                                     "robust_linear": relative_statistic}


def _supported(a: dict[str, Any], b: dict[str, Any], pa: Tensor | None, pb: Tensor | None,
               s: dict[str, Any], statistic: Statistic | None = None) -> bool | None:
    """Does the spread support a difference between two backbones' figures? The paired bootstrap over the same
    test images where both have per-image values; for means of seeded draws, the difference of the means against
    1.96 times its standard error; None where neither exists (robustness)."""
    if pa is not None and pb is not None and pa.shape == pb.shape:
        return bool(paired_difference(pa, pb, statistic, resamples=int(s["bootstrap"]), level=float(s["level"]),
                                      seed=int(s["seed"]))["supported"])
    if "se" in a and "se" in b and "draws" in a:
        se = math.sqrt(a["se"] ** 2 + b["se"] ** 2)
        return abs(a["value"] - b["value"]) > 1.96 * se if se > 0 else a["value"] != b["value"]
    return None


def comparisons(results: dict[str, dict[str, Any]], per_image: dict[str, dict[str, Tensor]],
                s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per metric: the ``best`` backbone, those whose difference to it the spread does not support
    (``tied_with_best``), and every pair (``pairs``: a, b, supported)."""
    metrics: dict[str, list[str]] = {}
    for name, r in results.items():
        for metric in r.get("metrics", {}):
            metrics.setdefault(metric, []).append(name)
    found = {}
    for metric, names in metrics.items():
        vals = {n: results[n]["metrics"][metric] for n in names}
        best = max(names, key=lambda n: vals[n]["value"])
        pairs, tied = [], []
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                sup = _supported(vals[a], vals[b], per_image.get(a, {}).get(metric), per_image.get(b, {}).get(metric),
                                 s, STATISTICS.get(metric))
                pairs.append({"a": a, "b": b, "difference": vals[a]["value"] - vals[b]["value"], "supported": sup})
                if best in (a, b) and sup is False:
                    tied.append(b if a == best else a)
        found[metric] = {"best": best, "tied_with_best": tied, "pairs": pairs}
    return found


def _cell(m: dict[str, Any] | None, mark: str) -> str:
    if m is None:
        return "-"
    text = f"{m['value']:.4f}"
    if "low" in m:
        text += f" [{m['low']:.3f}, {m['high']:.3f}]"
    elif "std" in m and len(m.get("draws", [])) > 1:
        text += f" ± {m['std']:.3f}"
    return f"**{text}**" if mark == "best" else text + (" ≈" if mark == "tied" else "")


def metric_order(record: dict[str, Any]) -> list[str]:
    """The metrics of a results record, in protocol order (the legend's), each protocol's in the order found."""
    seen: list[str] = []
    for name in record["backbones"]:
        for metric in record["results"].get(name, {}).get("metrics", {}):
            if metric not in seen:
                seen.append(metric)
    prefixes = ["knn_k", "linear", "fewshot_", "map_at_r", "recall_at_", "attentive", "dense_miou", "robust_"]

    def rank(metric: str) -> int:
        return next((i for i, p in enumerate(prefixes) if metric.startswith(p)), len(prefixes))
    return sorted(seen, key=rank)  # (stable: within a protocol, the order found)


def markdown_table(record: dict[str, Any]) -> str:
    """The table a person reads first: backbones x metrics, each figure with its interval ([low, high], the
    bootstrap's) or spread (± std of the draws); the best of a column in bold, ``≈`` on those whose difference to
    it the spread does not support; failed backbones with their reason."""
    metrics = metric_order(record)
    comp = record.get("comparisons", {})
    lines = ["| backbone | " + " | ".join(metrics) + " |", "| --- |" + " ---: |" * len(metrics)]
    for name in record["backbones"]:
        r = record["results"].get(name, {})
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:200]} |" + " |" * (len(metrics) - 1))
            continue
        cells = []
        for metric in metrics:
            c = comp.get(metric, {})
            mark = "best" if c.get("best") == name else "tied" if name in c.get("tied_with_best", []) else ""
            cells.append(_cell(r.get("metrics", {}).get(metric), mark))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    level = round(100 * float(record["settings"]["level"]))
    legend = [f"Figures are fractions; [low, high]: the {level}% percentile bootstrap interval over the test images "
              f"({record['settings']['bootstrap']} resamples); ± the standard deviation over seeded draws. Bold: the "
              "best of a column; ≈: its difference to the best is within the spread (paired bootstrap, or 1.96 "
              "standard errors of the draws' means). Settings chosen on a validation part of the train split only. "
              "-: not measured (the attentive probe reads patch tokens, which a CNN does not give; a backbone "
              "without a feature map has no dense figure)."]
    for metric in metrics:
        for prefix, what in LEGEND.items():
            if metric.startswith(prefix):
                legend.append(f"- `{metric}`: {what}")
                break
    return "\n".join(lines) + "\n\n" + "\n".join(legend) + "\n"


def _csv(record: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["backbone", "metric", "value", "low", "high", "se", "std", "best", "tied_with_best", "error"])
    comp = record.get("comparisons", {})
    for name in record["backbones"]:
        r = record["results"].get(name, {})
        if "error" in r:
            w.writerow([name, "", "", "", "", "", "", "", "", r["error"]])
            continue
        for metric, m in r.get("metrics", {}).items():
            c = comp.get(metric, {})
            w.writerow([name, metric, m["value"], m.get("low", ""), m.get("high", ""), m.get("se", ""),
                        m.get("std", ""), c.get("best") == name, name in c.get("tied_with_best", []), ""])
    return buf.getvalue()


def _picture(record: dict[str, Any], path: str) -> None:
    """Backbones x metrics as colours (each column scaled to its own range) with the figures written in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    metrics = metric_order(record)
    names = list(record["backbones"])
    grid = np.full((len(names), max(len(metrics), 1)), np.nan)
    for i, n in enumerate(names):
        for j, m in enumerate(metrics):
            v = record["results"].get(n, {}).get("metrics", {}).get(m)
            if v is not None:
                grid[i, j] = v["value"]
    lo, hi = np.nanmin(grid, axis=0, initial=np.inf), np.nanmax(grid, axis=0, initial=-np.inf)
    scaled = (grid - lo) / np.where(hi > lo, hi - lo, 1.0)
    fig, ax = plt.subplots(figsize=(1.1 * len(metrics) + 3, 0.45 * len(names) + 1.6))
    ax.imshow(np.nan_to_num(scaled, nan=0.0), cmap="viridis", aspect="auto", vmin=0, vmax=1)
    for i in range(len(names)):
        for j in range(len(metrics)):
            failed = "error" in record["results"].get(names[i], {})
            text = ("fail" if failed else "n/a") if np.isnan(grid[i, j]) else f"{grid[i, j]:.3f}"
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    color="white" if np.nan_to_num(scaled[i, j]) < 0.6 else "black")
    ax.set_xticks(range(len(metrics)), metrics, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_title(f"sslkit bench: {record['data']['name']} (colour: each column's own range)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(folder: str, record: dict[str, Any]) -> dict[str, str]:
    """``results.json``, ``results.md``, ``results.csv`` and ``results.png`` into ``folder``, each written whole."""
    os.makedirs(folder, exist_ok=True)
    paths = {ext: os.path.join(folder, f"results.{ext}") for ext in ("json", "md", "csv", "png")}
    text = json.dumps(record, indent=1, default=str)
    atomic_write(paths["json"], lambda f: f.write(text.encode()))
    md = f"# sslkit bench: {record['data']['name']}\n\n{markdown_table(record)}"
    atomic_write(paths["md"], lambda f: f.write(md.encode()))
    atomic_write(paths["csv"], lambda f: f.write(_csv(record).encode()))
    _picture(record, paths["png"])
    return paths


def compare_folders(folders: list[str]) -> str:
    """Earlier results folders side by side: one row per (folder, backbone), the union of their metrics as
    columns, each figure with its interval; a folder's data and date in the rows' legend."""
    records = []
    for folder in folders:
        path = os.path.join(folder, "results.json") if os.path.isdir(folder) else folder
        with open(path, encoding="utf-8") as f:
            records.append((folder, json.load(f)))
    metrics: list[str] = []
    for _, r in records:
        metrics += [m for m in metric_order(r) if m not in metrics]
    lines = ["| results | backbone | " + " | ".join(metrics) + " |", "| --- | --- |" + " ---: |" * len(metrics)]
    notes = []
    for i, (folder, r) in enumerate(records, 1):
        notes.append(f"[{i}] {folder}: data {r['data']['name']}, {r.get('finished', '?')}, sslkit bench "
                     f"settings seed {r['settings']['seed']}")
        for name in r["backbones"]:
            res = r["results"].get(name, {})
            cells = [_cell(res.get("metrics", {}).get(m), "") for m in metrics]
            lines.append(f"| [{i}] | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"
