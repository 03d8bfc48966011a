"""A run folder read without code: ``sslkit report RUN_DIR`` writes report.md (the summary) and plots/*.png."""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
from typing import Any

from sslkit.errors import EXIT_BAD_INPUT, UserError, plural

__all__ = ["ReportError", "main", "read_metrics", "summarize", "write_report"]

logger = logging.getLogger("sslkit")

#: Metric names of the online monitors, by prefix (their last values are reported).
MONITOR_PREFIXES = ("rankme_", "online_linear_", "embedding_std", "feature_std")


class ReportError(UserError):
    """The folder is not a run folder (or holds nothing to report); the message names the path."""


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a line torn by a killed run (not JSON) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
        return found if isinstance(found, dict) else None
    except (OSError, json.JSONDecodeError):
        return None


def _last_per_step(records: list[dict[str, Any]], key: str, phase: str = "train") -> list[tuple[int, float]]:
    """``(step, value)`` of the ``phase`` records holding ``key``; a step logged twice (a resumed run repeats the
    steps after its last checkpoint) keeps its last value."""
    found: dict[int, float] = {}
    for r in records:
        if r.get("phase") == phase and key in r and isinstance(r[key], int | float):
            found[int(r.get("step", 0))] = float(r[key])
    return sorted(found.items())


def _recipe_diff(run_dir: str, cfg: Any) -> list[str] | None:
    """``key: recipe -> run`` lines of the config's difference from its recipe (None: command.json is missing)."""
    command = _read_json(os.path.join(run_dir, "command.json"))
    if command is None or not isinstance(command.get("argv"), list):
        return None
    from sslkit.config.diff import recipe_diff, show_value

    try:
        diffs = recipe_diff([str(a) for a in command["argv"]], cfg)
    except Exception as exc:  # a recipe renamed or removed since the run
        return [f"(the recipe named in command.json cannot be composed today: {exc})"]
    return [f"{key}: {show_value(before)} -> {show_value(after)}" for key, before, after in diffs]


def summarize(run_dir: str) -> dict[str, Any]:
    """The figures of the run in ``run_dir``: name, method, status, steps, wall time, median images/s, final loss,
    kNN and linear top-1/top-5, the monitors' last values, and the config's difference from its recipe.

    Raises :class:`ReportError` when ``run_dir`` is not a run folder (no ``metrics.jsonl``)."""
    if not os.path.isdir(run_dir):
        raise ReportError(f"{run_dir}: no such folder. Give a run's output_dir (e.g. runs/simclr-fashion_mnist).")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics_path):
        raise ReportError(f"{run_dir} holds no metrics.jsonl: not a run folder, or a run that stopped before its "
                          "first logged step.")
    records = read_metrics(metrics_path)
    train = [r for r in records if r.get("phase") == "train"]
    cfg = None
    if os.path.exists(os.path.join(run_dir, "config.yaml")):
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    info: dict[str, Any] = {"run_dir": run_dir, "name": str(cfg.get("name")) if cfg is not None else
                            os.path.basename(os.path.abspath(run_dir))}
    if cfg is not None:
        info["method"] = str(cfg.get("method", {}).get("name", "?"))
        info["trunk"] = str(cfg.get("model", {}).get("trunk", "?"))
    last_step = max((int(r.get("step", 0)) for r in train), default=0)
    info["steps"] = last_step
    info["finished"] = bool(train) and train[-1].get("eta_s") == 0.0  # the log hook's ETA at the last step
    info["wall_s"], info["parts"] = training_time(train)
    speeds = [float(r["img_per_s"]) for r in train if isinstance(r.get("img_per_s"), int | float)]
    info["median_img_per_s"] = statistics.median(speeds) if speeds else None
    info["final_loss"] = final_loss(_last_per_step(records, "loss"), last_step)
    knn = [r for r in records if "knn_top1" in r]
    if knn:
        info["knn"] = {"top1": knn[-1]["knn_top1"], "top5": knn[-1].get("knn_top5"), "step": knn[-1].get("step"),
                       "from": "metrics.jsonl"}
    curve = _last_per_step(records, "knn_curve_top1", phase="eval")
    if curve:
        info["knn_curve"] = curve
    reference = {key[len("ref_"):-len("_knn_top1")]: _last_per_step(records, key, phase="eval")
                 for key in sorted({k for r in records for k in r if k.startswith("ref_") and k.endswith("_knn_top1")})}
    if reference:
        info["reference"] = reference
    for name in ("knn", "linear", "finetune"):
        found = _read_json(os.path.join(run_dir, "eval", f"{name}.json"))
        if found is not None and found.get("top1") is not None:
            entry = {"top1": found["top1"], "top5": found.get("top5"), "step": found.get("step"),
                     "from": f"eval/{name}.json"}
            if name in ("linear", "finetune"):
                entry["epochs_done"] = found.get("epochs_done")
                entry["done"] = found.get("done")
                entry["curve"] = [(r.get("epoch"), r.get("top1")) for r in found.get("epochs", [])]
            if name == "knn" and "knn" in info and info["knn"].get("step") == found.get("step"):
                info["knn"]["tool"] = entry  # the same checkpoint evaluated again
            else:
                info[name if name not in info else f"{name}_tool"] = entry
    bench = _read_json(os.path.join(run_dir, "bench", "results.json"))
    if bench is not None and bench.get("backbones"):
        own = bench["results"].get(bench["backbones"][0], {})
        info["bench"] = {"from": "bench/results.md", "error": own.get("error"),
                         "figures": {k: v["value"] for k, v in own.get("metrics", {}).items()},
                         "others": bench["backbones"][1:]}
    monitors: dict[str, float] = {}
    for r in records:
        for key, value in r.items():
            if key.startswith(MONITOR_PREFIXES) and isinstance(value, int | float):
                monitors[key] = float(value)
    info["monitors"] = monitors
    info["warnings"] = [(r.get("step"), r["warning"], r.get("message", "")) for r in records
                        if r.get("phase") == "warning" and "warning" in r]  # sslkit.stability's, once each
    from sslkit.data.notices import read_notices

    info["data_notices"] = read_notices(run_dir)  # what the data layer said once for the run (channels converted)
    info["recipe_diff"] = _recipe_diff(run_dir, cfg) if cfg is not None else None
    return info


def training_time(train: list[dict[str, Any]]) -> tuple[float | None, int]:
    """``(seconds, parts)``: the training time of a run over its resumes and the number of processes that trained
    it. Each process's log records count ``elapsed_s`` from its own start, so a record whose ``elapsed_s`` is below
    the one before starts a new part; a part's time is its last ``elapsed_s`` (the time after a part's last record,
    at most one log interval before a crash, is not counted)."""
    parts: list[float] = []
    before = None
    for record in train:
        if "elapsed_s" not in record:
            continue
        now = float(record["elapsed_s"])
        if before is None or now < before:
            parts.append(now)
        parts[-1] = now
        before = now
    return (sum(parts) if parts else None), len(parts)


def final_loss(losses: list[tuple[int, float]], last_step: int) -> dict[str, Any] | None:
    """The loss at the end of training: the mean of the values logged in the last 10% of the steps (at least the
    last one), with how many and from which step, so a short run's average does not reach back to its start."""
    if not losses:
        return None
    since = last_step - max(last_step // 10, 0)
    tail = [(step, v) for step, v in losses if step >= since] or losses[-1:]
    return {"value": sum(v for _, v in tail) / len(tail), "count": len(tail), "from_step": tail[0][0],
            "to_step": tail[-1][0]}


def _parts_text(parts: int) -> str:
    return "" if parts <= 1 else f" in {parts} parts (resumed {plural(parts - 1, 'time')}; their sum)"


def _loss_text(loss: dict[str, Any] | None) -> str:
    if loss is None:
        return "n/a"
    if loss["count"] == 1:
        return f"{loss['value']:.4f} (logged at step {loss['to_step']})"
    return (f"{loss['value']:.4f} (mean of the {loss['count']} values logged in the last 10% of the steps, "
            f"{loss['from_step']}-{loss['to_step']})")


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    from sslkit.hooks.logging import format_duration

    return format_duration(seconds)


def _change(start: float, end: float) -> str:
    """``end`` against ``start``: the difference in points and as a fraction of the start."""
    relative = f", {100 * (end - start) / start:+.1f}% of the start" if start > 0 else ""
    return f"{100 * (end - start):+.1f} points{relative}"


def _text(info: dict[str, Any], plots: list[str]) -> str:
    lines = [f"# Run {info['name']}", ""]
    what = f"{info.get('method', '?')} with a {info.get('trunk', '?')} trunk"
    status = "finished" if info["finished"] else "not finished (stopped or still running)"
    lines += [f"- {what}: {status} at step {info['steps']}",
              f"- training time {_duration(info['wall_s'])}{_parts_text(info['parts'])}, median "
              f"{_fmt(info['median_img_per_s'], ',.0f')} images/s",
              f"- final loss {_loss_text(info['final_loss'])}"]
    for name, label in (("knn", "kNN"), ("knn_tool", "kNN (sslkit knn)"), ("linear", "linear probe"),
                        ("linear_tool", "linear probe"), ("finetune", "fine-tuning")):
        entry = info.get(name)
        if not entry:
            continue
        extra = ""
        if name.startswith(("linear", "finetune")):
            done = entry.get("epochs_done")
            extra = (f", {plural(done, 'epoch')}" if isinstance(done, int) else f", {done} epochs") + (
                "" if entry.get("done") else " (not finished)")
        lines.append(f"- {label} top-1 {_fmt(entry['top1'])}, top-5 {_fmt(entry.get('top5'))} "
                     f"(step {entry.get('step')}, {entry['from']}{extra})")
        if "tool" in entry:
            lines.append(f"  - again with sslkit knn: top-1 {_fmt(entry['tool']['top1'])}")
    if info.get("knn_curve"):
        points = info["knn_curve"]
        shown = " -> ".join(f"{v:.3f}" for _, v in points[-8:])
        best_step, best = max(points, key=lambda p: p[1])
        lines.append(f"- kNN curve ({len(points)} points{', the last 8' if len(points) > 8 else ''}): {shown}; best "
                     f"{best:.4f} at step {best_step}")
    for name, points in info.get("reference", {}).items():
        start, end = points[0][1], points[-1][1]
        low_step, low = min(points, key=lambda p: p[1])
        lines.append(f"- reference set {name} (kNN top-1): {start:.4f} at step {points[0][0]} -> {end:.4f} at step "
                     f"{points[-1][0]} ({_change(start, end)}); lowest {low:.4f} at step {low_step}")
    if "bench" in info:
        b = info["bench"]
        shown = ", ".join(f"{k} {_fmt(v)}" for k, v in b["figures"].items()) or f"failed: {b['error']}"
        lines.append(f"- bench ([{b['from']}]({b['from']}), beside {', '.join(b['others']) or 'nothing'}): {shown}")
    if "linear" not in info:
        lines.append(f"- linear probe: not run (sslkit linear checkpoint={info['run_dir']})")
    if info["monitors"]:
        shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(info["monitors"].items()))
        lines.append(f"- monitors (last values): {shown}")
    for step, key, message in info.get("warnings", []):
        lines.append(f"- stability warning `{key}` at step {step}: {message}")
    for message in info.get("data_notices", []):
        lines.append(f"- data warning: {message}")
    lines += ["", "## Config"]
    diff = info["recipe_diff"]
    if diff is None:
        lines.append("The command that started the run is unknown (no command.json): see config.yaml.")
    elif not diff:
        lines.append("As its recipe and data preset (the full config is config.yaml).")
    else:
        lines.append("Changed from its recipe and data preset (recipe -> run; the full config is config.yaml):")
        lines += [f"- {d}" for d in diff]
    if plots:
        lines += ["", "## Plots", *[f"![{os.path.splitext(p)[0]}](plots/{p})" for p in plots]]
    return "\n".join(lines) + "\n"


def _plots(run_dir: str, info: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """loss.png, lr.png and eval.png in ``<run_dir>/plots`` (those with data); the file names written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    folder = os.path.join(run_dir, "plots")
    os.makedirs(folder, exist_ok=True)
    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(os.path.join(folder, name), dpi=100)
        plt.close(fig)
        written.append(name)

    for key, name, label in (("loss", "loss.png", "loss"), ("lr", "lr.png", "learning rate")):
        points = _last_per_step(records, key)
        if points:
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot([s for s, _ in points], [v for _, v in points])
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(label)
            ax.set_title(f"{info['name']}: {label}")
            ax.grid(alpha=0.3)
            save(fig, name)
    # (title, x label, [(legend, points, style)]): one axis per title
    curves: list[tuple[str, str, list[tuple[str, list[tuple[Any, float]], str]]]] = []
    knn_lines = []
    if info.get("knn_curve"):
        knn_lines.append(("every epoch (eval.knn.every_n_epochs; a fixed subsample on the CPU)", info["knn_curve"],
                          "o-"))
    knn = [(int(r.get("step", 0)), float(r["knn_top1"])) for r in records if "knn_top1" in r]
    if knn:
        knn_lines.append(("end of run (every sample)", knn, "*"))
    if knn_lines:
        curves.append(("kNN top-1", "step", knn_lines))
    if info.get("reference"):
        curves.append(("reference sets: kNN top-1 (eval.reference)", "step",
                       [(name, points, "o-") for name, points in info["reference"].items()]))
    for key in sorted({k for r in records for k in r if k.startswith(("online_linear", "rankme_"))}):
        points = [(int(r.get("step", 0)), float(r[key])) for r in records if isinstance(r.get(key), int | float)]
        if points:
            curves.append((key, "step", [("", points, "o-")]))
    linear = info.get("linear") or info.get("linear_tool")
    if linear and linear.get("curve"):
        curves.append(("linear probe top-1 (sslkit linear)", "probe epoch",
                       [("", [(e, v) for e, v in linear["curve"] if e is not None and v is not None], "o-")]))
    if curves:
        fig, axes = plt.subplots(len(curves), 1, figsize=(6, 2.6 * len(curves)), squeeze=False)
        for ax, (label, xlabel, lines) in zip(axes[:, 0], curves):
            for legend, points, style in lines:
                ax.plot([x for x, _ in points], [y for _, y in points], style, markersize=3 if style == "o-" else 10,
                        label=legend or None)
            if any(legend for legend, _, _ in lines):
                ax.legend(fontsize=7)
            ax.set_title(label)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
        save(fig, "eval.png")
    return written


def write_report(run_dir: str) -> str:
    """Write ``<run_dir>/report.md`` and ``<run_dir>/plots/*.png``; returns the report's text."""
    from sslkit.files import atomic_write

    info = summarize(run_dir)
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    plots = _plots(run_dir, info, records)
    text = _text(info, plots)
    atomic_write(os.path.join(run_dir, "report.md"), lambda f: f.write(text.encode()))
    return text


def main(argv: list[str] | None = None) -> int:
    """``sslkit report RUN_DIR``: write and print the run's summary; exit 2 with a message for a wrong folder."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or any(a in ("-h", "--help") for a in args) or len(args) != 1:
        print("usage: sslkit report RUN_DIR\n\nWrites RUN_DIR/report.md (time, images/s, final loss, kNN and linear "
              "figures, the config's changes from its recipe) and loss, lr and evaluation plots in RUN_DIR/plots/.")
        return 0 if args and args[0] in ("-h", "--help") else EXIT_BAD_INPUT
    try:
        text = write_report(args[0])
    except ReportError as exc:
        print(f"sslkit report: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(text, end="")
    print(f"(written to {os.path.join(args[0], 'report.md')}, plots in {os.path.join(args[0], 'plots')})")
    return 0
