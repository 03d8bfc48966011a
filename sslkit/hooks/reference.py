"""ReferenceSetsHook: forgetting watched while it happens: labelled reference sets evaluated by kNN during training."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sslkit.evaluation import FeatureEncoder, extract_features, weighted_knn
from sslkit.hooks.base import Slot, SSLHook
from sslkit.hooks.logging import MetricsSink
from sslkit.registry import register_hook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["ReferenceSet", "ReferenceSetsHook", "reference_key"]

logger = logging.getLogger("sslkit")


@dataclass
class ReferenceSet:
    """One labelled reference set (a sample of the old domain, or of the new): ``memory`` and ``queries`` loaders
    over two stratified halves of it (the kNN's neighbours and the images it classifies), ``num_classes`` labels."""

    name: str
    memory: Iterable[dict[str, Any]]
    queries: Iterable[dict[str, Any]]
    num_classes: int


def reference_key(name: str) -> str:
    """The metric a reference set's kNN top-1 is logged as (``metrics.jsonl``, the report's plot)."""
    return f"ref_{name}_knn_top1"


@register_hook("reference_sets")
class ReferenceSetsHook(SSLHook):
    """Each reference set's weighted kNN top-1 (:func:`~sslkit.evaluation.weighted_knn`, ``k`` neighbours,
    ``temperature``) of the trunk's features: at the start of a fresh run (its *start*), after every
    ``every_n_steps`` optimizer updates, and at the end; logged as ``ref_<name>_knn_top1`` (with the drop from the
    start, ``ref_<name>_drop``) to the log and the sinks. A set whose top-1 falls below ``(1 - warn_drop)`` times its
    start gets a warning in the log, once per fall (again after it has recovered and fallen again).

    The evaluation runs under :func:`torch.random.fork_rng`, so that it draws nothing from the training's random
    streams: a run with reference sets trains on the same batches, augmentations and masks as one without, and a
    resumed run as the uninterrupted one. State (checkpointed): the start values, the last evaluated update, every
    figure so far and which sets are below the line."""

    name = "reference_sets"
    slot = Slot.EVAL

    def __init__(self, sets: list[ReferenceSet], every_n_steps: int = 0, k: int = 20, temperature: float = 0.1,
                 warn_drop: float = 0.1, sinks: list[MetricsSink] | None = None, features: str = "pool",
                 last_n: int = 4, warn: bool = True) -> None:
        names = [s.name for s in sets]
        if len(set(names)) != len(names):
            raise ValueError(f"reference sets need distinct names, got {names}")
        self.sets, self.every_n_steps = list(sets), int(every_n_steps)
        self.k, self.temperature, self.warn_drop = int(k), float(temperature), float(warn_drop)
        self.warn = bool(warn)  # false from a random init: its start figures are no knowledge to lose
        self.sinks = sinks or []
        self.features, self.last_n = str(features), int(last_n)
        self.start: dict[str, float] = {}
        self.history: list[dict[str, Any]] = []
        self.below: dict[str, bool] = {}
        self.last_step = -1

    def evaluate(self, task: SSLTask) -> dict[str, float]:
        """Every set's kNN top-1 of the trunk now (nothing drawn from the training's random streams)."""
        encoder = FeatureEncoder(task.base_model.trunk, self.features, self.last_n)
        devices = [task.device.index or 0] if task.device.type == "cuda" else []
        found = {}
        with torch.random.fork_rng(devices=devices, device_type=task.device.type):
            for s in self.sets:
                memory_f, memory_y = extract_features(encoder, s.memory, task.device, task.amp_dtype)
                query_f, query_y = extract_features(encoder, s.queries, task.device, task.amp_dtype)
                k = min(self.k, len(memory_f))
                found[s.name] = weighted_knn(memory_f, memory_y, query_f, query_y, s.num_classes, k,
                                             self.temperature)["knn_top1"]
        return found

    def _record(self, task: SSLTask) -> None:
        """Evaluate, log, write to the sinks and warn: once per optimizer update."""
        update = task.clock.step
        if update == self.last_step:
            return
        found = self.evaluate(task)
        self.last_step = update
        if not self.start:
            self.start = dict(found)
        record: dict[str, Any] = {"step": update, "epoch": task.epoch, "phase": "eval"}
        for name, value in found.items():
            drop = 1.0 - value / self.start[name] if self.start[name] > 0 else 0.0
            record[reference_key(name)] = value
            record[f"ref_{name}_drop"] = drop
            self._warn(name, value, drop, update)
        self.history.append(dict(record))
        logger.info("reference sets at step %d (kNN k=%d): %s", update, self.k,
                    ", ".join(f"{n} {v:.4f} (start {self.start[n]:.4f})" for n, v in found.items()))
        for sink in self.sinks:
            sink.write(record)

    def _warn(self, name: str, value: float, drop: float, update: int) -> None:
        below = self.warn and drop > self.warn_drop
        if below and not self.below.get(name, False):
            logger.warning("reference set %s: kNN top-1 %.4f at step %d, %.0f%% below its %.4f at the start "
                           "(eval.reference.warn_drop=%g): the backbone is forgetting it. Lower the learning rate, "
                           "lengthen the heads' warm-up or anchor to the starting model (config=dinov3_adapt: gram.*)",
                           name, value, update, 100 * drop, self.start[name], self.warn_drop)
        self.below[name] = below

    def on_phase_start(self, task: SSLTask) -> None:
        """The start figures, before the first update of a fresh run."""
        if task.train and not self.start and task.clock.step == 0:
            self._record(task)

    def on_update(self, task: SSLTask) -> None:
        """After every ``every_n_steps`` optimizer updates."""
        if self.every_n_steps > 0 and task.clock.step % self.every_n_steps == 0:
            self._record(task)

    def on_end(self, task: SSLTask) -> None:
        """The final figures (unless the last update was just evaluated)."""
        self._record(task)

    def state_dict(self) -> dict[str, Any]:
        """The start values, the last evaluated update, the figures so far and which sets are below the line."""
        return {"start": dict(self.start), "last_step": self.last_step, "history": list(self.history),
                "below": dict(self.below)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.start = dict(state["start"])
        self.last_step = int(state["last_step"])
        self.history = list(state["history"])
        self.below = dict(state["below"])
