"""KNNHook: weighted kNN top-1 of the trunk's features at the end of pretraining (and every N epochs)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from sslkit.evaluation import FeatureEncoder, extract_features, pixel_features, weighted_knn
from sslkit.hooks.base import Slot, SSLHook
from sslkit.hooks.logging import MetricsSink
from sslkit.registry import register_hook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["KNNHook"]

logger = logging.getLogger("sslkit")


@register_hook("knn")
class KNNHook(SSLHook):
    """kNN evaluation (InstDisc protocol: cosine similarity, k neighbours weighted by exp(s/T)).

    The train split (with the eval transform) is the memory bank, the test split the queries.
    Runs on ``on_end`` once (a finished run that is started again reports the stored result
    instead of recomputing it), after every ``every_n_epochs`` train epochs if > 0 (``knn_curve_top1``, on
    ``curve_loaders`` with ``curve_k`` neighbours when given: a fixed subsample, the cheap curve of a CPU run), and,
    with ``baselines``, once at the start of a fresh run's first phase for the random-init trunk and the pixels
    (raw in [0, 1] through ``raw_pixel_loaders``, and as the eval transform normalises them).
    Results go to the log and the sinks (metrics.jsonl). ``features`` and ``last_n`` say what is read from a
    ViT trunk (``eval.vit_features``: :class:`~sslkit.evaluation.FeatureEncoder`); a CNN gives ``pool``, its own.
    """

    name = "knn"
    slot = Slot.EVAL

    def __init__(
        self,
        train_loader: Iterable[dict[str, Any]],
        test_loader: Iterable[dict[str, Any]],
        num_classes: int,
        k: int = 200,
        temperature: float = 0.1,
        every_n_epochs: int = 0,
        baselines: bool = False,
        sinks: list[MetricsSink] | None = None,
        raw_pixel_loaders: tuple[Iterable[dict[str, Any]], Iterable[dict[str, Any]]] | None = None,
        features: str = "pool",
        last_n: int = 4,
        curve_loaders: tuple[Iterable[dict[str, Any]], Iterable[dict[str, Any]]] | None = None,
        curve_k: int | None = None,
    ) -> None:
        self.train_loader = train_loader
        self.test_loader = test_loader
        self.num_classes = num_classes
        self.k = k
        self.temperature = temperature
        self.every_n_epochs = every_n_epochs
        self.baselines = baselines
        self.sinks = sinks or []
        self.raw_pixel_loaders = raw_pixel_loaders
        self.features, self.last_n = str(features), int(last_n)
        self.curve_loaders = curve_loaders
        self.curve_k = curve_k
        self.results: dict[str, float] = {}
        self.done = False
        #: The step and the settings of the final evaluation in ``results`` (-1 and {} before it).
        self.step = -1
        self.done_with: dict[str, Any] = {}
        self._warned = False
        self._used_k = self.k  # the k of the latest evaluation (lowered to the memory's size when larger)

    def evaluate(self, task: SSLTask, encoder: torch.nn.Module | None = None,
                 loaders: tuple[Iterable[dict[str, Any]], Iterable[dict[str, Any]]] | None = None,
                 k: int | None = None) -> dict[str, float]:
        """kNN accuracies of ``encoder`` (by default the trunk, read as ``features`` says) on ``loaders`` (memory,
        queries; by default the whole train and test splits) with ``k`` neighbours (by default ``self.k``)."""
        if encoder is None:
            encoder = FeatureEncoder(task.base_model.trunk, self.features, self.last_n)
        memory, queries = loaders or (self.train_loader, self.test_loader)
        train_f, train_y = extract_features(encoder, memory, task.device, task.amp_dtype)
        test_f, test_y = extract_features(encoder, queries, task.device, task.amp_dtype)
        used = self._k(len(train_f)) if k is None else min(k, len(train_f))
        self._used_k = used
        return weighted_knn(train_f, train_y, test_f, test_y, self.num_classes, used, self.temperature)

    def _k(self, memory: int) -> int:
        """k, or the memory size when k is larger, which is said once in the log (every memory sample would
        be a neighbour: the result then measures the class balance more than the features)."""
        if self.k > memory and not self._warned:
            logger.warning("kNN: eval.knn.k=%d but the memory (the train split) has %d samples: using k=%d, every "
                           "sample a neighbour, so the accuracy says little about the features. Lower eval.knn.k "
                           "or use more data.", self.k, memory, memory)
            self._warned = True
        self._used_k = min(self.k, memory)
        return self._used_k

    def _report(self, task: SSLTask, results: dict[str, float], prefix: str = "") -> None:
        """Log the results (with the k they were computed with) and write them to the sinks."""
        record: dict[str, Any] = {"step": task.clock.step, "epoch": task.epoch, "phase": "eval"}
        record.update({prefix + key: v for key, v in results.items()})
        logger.info("kNN at step %d (k=%d, T=%g) %s", task.clock.step, self._used_k, self.temperature,
                    ", ".join(f"{k} {v:.4f}" for k, v in record.items() if k.startswith(prefix + "knn")))
        for sink in self.sinks:
            sink.write(record)

    def on_phase_start(self, task: SSLTask) -> None:
        """Baselines at the start of a fresh run's first phase: the random-init trunk, the raw pixels in
        [0, 1] (the protocol's pixel baseline) and the pixels as the eval transform normalises them
        (centred). At the first phase start, not ``on_start``, so every hook is set up by then (the
        pre-emption handlers too: a Ctrl-C during the baselines stops after the first step, with a
        checkpoint)."""
        if (not self.baselines or task.clock.step > 0 or task.phase_idx > 0 or task.clock.step_in_epoch > 0
                or "random_init_knn_top1" in self.results):
            return
        self._baseline(task, "random_init_", self.evaluate(task))
        if self.raw_pixel_loaders is not None:
            self._baseline(task, "pixels_", self._pixels(*self.raw_pixel_loaders))
        self._baseline(task, "pixels_normalised_", self._pixels(self.train_loader, self.test_loader))

    def _pixels(self, train_loader: Iterable[dict[str, Any]], test_loader: Iterable[dict[str, Any]]
                ) -> dict[str, float]:
        train_f, train_y = pixel_features(train_loader)
        test_f, test_y = pixel_features(test_loader)
        return weighted_knn(train_f, train_y, test_f, test_y, self.num_classes, self._k(len(train_f)),
                            self.temperature)

    def _baseline(self, task: SSLTask, prefix: str, results: dict[str, float]) -> None:
        self.results.update({prefix + k: v for k, v in results.items()})
        self._report(task, results, prefix)

    def on_phase_end(self, task: SSLTask) -> None:
        """Every ``every_n_epochs`` train epochs, if > 0: a point of the curve, ``knn_curve_top1`` (on
        ``curve_loaders``, a fixed subsample, when given), apart from the final ``knn_top1``."""
        if task.train and self.every_n_epochs > 0 and (task.epoch + 1) % self.every_n_epochs == 0:
            found = self.evaluate(task, loaders=self.curve_loaders, k=self.curve_k)
            self._report(task, {key.replace("knn_", "knn_curve_"): v for key, v in found.items()})

    @property
    def settings(self) -> dict[str, Any]:
        """What a result depends on besides the weights: k, the temperature and the features read."""
        settings: dict[str, Any] = {"k": self.k, "temperature": self.temperature}
        if self.features != "pool":
            settings["features"] = self.features if self.features != "cls_last_n" else f"cls_last_{self.last_n}"
        return settings

    def on_end(self, task: SSLTask) -> None:
        """The final evaluation, once per trained state: a finished run started again reports the stored
        result only if it was computed at this very step with the same settings; a lengthened run (or
        new eval.knn settings) evaluates again."""
        if self.done and self.step == task.clock.step and self.done_with == self.settings:
            logger.info("kNN already evaluated for this run at step %d: %s", self.step,
                        ", ".join(f"{k} {v:.4f}" for k, v in self.results.items() if k.startswith("knn")))
            return
        final = self.evaluate(task)
        self.results.update(final)
        self.done, self.step, self.done_with = True, task.clock.step, self.settings
        self._report(task, final)

    def state_dict(self) -> dict[str, Any]:
        """Whether the final evaluation ran, at which step and with which settings, and the results."""
        return {"done": self.done, "step": self.step, "settings": dict(self.done_with), "results": dict(self.results)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.done = bool(state["done"])
        self.step = int(state["step"])
        self.done_with = dict(state["settings"])
        self.results = dict(state["results"])
