"""Forgetting watched while it happens (``eval.reference``) and ``data.classes``: the sets are stratified halves of
their classes, a run logs and plots each set's kNN from its start to its end and trains exactly as without them, a
fall below the line is warned once per fall, and a set without labels stops the command before the run folder."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import SMALL, run_main
from PIL import Image
from torch import nn

from sslkit.builder.data import eval_sources, open_source, reference_sets, select_classes
from sslkit.config.compose import compose_config
from sslkit.data.sources import DataSourceError, TensorImageDataset, dataset_labels
from sslkit.hooks.reference import ReferenceSet, ReferenceSetsHook

QUIET = ["eval.knn.enabled=false", "log.tensorboard=false"]


def test_data_classes_keeps_those_labels_in_every_split_and_names_what_is_wrong() -> None:
    ds = TensorImageDataset(torch.zeros(12, 1, 4, 4, dtype=torch.uint8), torch.arange(12) % 4, num_classes=4)
    kept = select_classes(ds, [1, 3])
    assert dataset_labels(kept).tolist() == [1, 3, 1, 3, 1, 3]  # labels kept as they are, in dataset order
    assert kept.num_classes == 4 and select_classes(ds, []) is ds
    with pytest.raises(DataSourceError, match=re.escape("data.classes=[1, 7]: the data has classes 0-3, not [7]")):
        select_classes(ds, [1, 7])
    cfg = compose_config(["config=simclr", *SMALL, "data.classes=[2, 5]", "data.limit=0"])
    train, test, classes = eval_sources(cfg)
    for split in (train, test, open_source(cfg, "synthetic", "train", None, {"num_samples": 64})):
        assert set(dataset_labels(split).tolist()) == {2, 5}
    assert classes == 10


def test_reference_sets_are_stratified_halves_of_their_own_classes() -> None:
    """Each set: ``samples`` of its classes (``data.classes`` does not apply), halved by class into the kNN's
    neighbours and queries, disjoint; the draw is the seed's."""
    cfg = compose_config(["config=simclr", *SMALL, "data.classes=[0]", "data.test.kwargs={num_samples: 400}",
                          "data.train.kwargs.num_samples=400",
                          "eval.reference.sets=[{name: old, classes: [0, 1, 2]}, {name: new, classes: [7, 8], "
                          "samples: 60, split: train}]"])
    found = reference_sets(cfg)
    assert [f[0] for f in found] == ["old", "new"]
    for (name, memory, queries, classes), wanted, size in zip(found, ([0, 1, 2], [7, 8]), (None, 60), strict=True):
        m, q = dataset_labels(memory), dataset_labels(queries)
        assert classes == 10 and set(m.tolist()) == set(q.tolist()) == set(wanted), name
        for c in wanted:  # halves by class
            assert abs(int((m == c).sum()) - int((q == c).sum())) <= 1
        assert not set(memory.indices) & set(queries.indices)
        if size is not None:
            assert len(m) + len(q) == size
    again = reference_sets(cfg)
    assert again[1][1].indices == found[1][1].indices  # the same draw every time (every rank, every resume)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_logs_each_sets_knn_from_start_to_end_and_trains_exactly_as_without_them(tmp_path: Path) -> None:
    """Start (step 0), every 2 updates and the end, in metrics.jsonl with the drop from the start, in the report
    and its plot; the evaluations draw nothing from the training's random streams: the losses are bit for bit those
    of the same run without reference sets."""
    base = ["config=simclr", *SMALL, *QUIET, "optim.epochs=2", "data.train.kwargs.num_samples=48"]
    sets = "eval.reference.sets=[{name: old, classes: [0, 1, 2, 3, 4]}, {name: new, classes: [5, 6, 7, 8, 9]}]"
    watched, plain = tmp_path / "watched", tmp_path / "plain"
    run_main(*base, sets, "eval.reference.every_n_steps=2", "eval.reference.k=3", "log.report=true",
             f"output_dir={watched}")
    run_main(*base, f"output_dir={plain}")
    records = _records(watched)
    steps = [r["step"] for r in records if "ref_old_knn_top1" in r]
    assert steps == [0, 2, 4, 6]  # 3 updates an epoch: the start, every 2 updates, the end (update 6, once)
    assert all(0.0 <= r["ref_new_knn_top1"] <= 1.0 for r in records if "ref_new_knn_top1" in r)
    first = next(r for r in records if "ref_old_knn_top1" in r)
    assert first["ref_old_drop"] == 0.0
    last = [r for r in records if "ref_old_knn_top1" in r][-1]
    assert last["ref_old_drop"] == pytest.approx(1 - last["ref_old_knn_top1"] / first["ref_old_knn_top1"])

    def losses(run: Path) -> list[tuple[int, float]]:
        return [(r["step"], r["loss"]) for r in _records(run) if r.get("phase") == "train" and "loss" in r]

    assert losses(watched) == losses(plain) and losses(plain)
    report = (watched / "report.md").read_text()
    assert re.search(r"reference set old \(kNN top-1\): [01]\.\d{4} at step 0 -> [01]\.\d{4} at step 6", report)
    assert (watched / "plots" / "eval.png").exists()


class _Switch(nn.Module):
    """Features that separate the two classes (the image's mean brightness) or, switched off, say nothing (one
    constant vector: every neighbour ties, the lowest class wins)."""

    def __init__(self) -> None:
        super().__init__()
        self.good = True
        self.out_dim = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bright = x.flatten(1).mean(dim=1, keepdim=True)
        if self.good:
            return torch.cat([bright, 1.0 - bright], dim=1)
        return torch.ones(x.shape[0], 2)


def _batches(labels: list[int]) -> list[dict]:
    x = torch.stack([torch.full((1, 4, 4), 0.9 if y else 0.1) + 0.01 * i for i, y in enumerate(labels)])
    return [{"input": [x], "target": torch.tensor(labels)}]


def test_a_fall_below_the_line_is_warned_once_per_fall_and_the_state_survives_a_resume(
        caplog: pytest.LogCaptureFixture) -> None:
    trunk = _Switch()
    task = SimpleNamespace(base_model=SimpleNamespace(trunk=trunk), device=torch.device("cpu"), amp_dtype=None,
                           clock=SimpleNamespace(step=0), epoch=0, train=True)
    labels = [0, 1] * 4
    hook = ReferenceSetsHook([ReferenceSet("old", _batches(labels), _batches(labels[::-1]), 2)], every_n_steps=1,
                             k=3, warn_drop=0.2)
    hook.on_phase_start(task)
    assert hook.start == {"old": 1.0}
    warnings = []
    for update, good in enumerate([False, False, True, False], start=1):  # 1.0 -> 0.5 -> 0.5 -> 1.0 -> 0.5
        trunk.good, task.clock.step = good, update
        with caplog.at_level(logging.WARNING, logger="sslkit"):
            caplog.clear()
            hook.on_update(task)
        warnings.append(sum("forgetting" in r.getMessage() for r in caplog.records))
    assert warnings == [1, 0, 0, 1]  # at the fall, not while still below, not at the recovery, again at a new fall
    assert [h["ref_old_knn_top1"] for h in hook.history] == [1.0, 0.5, 0.5, 1.0, 0.5]
    resumed = ReferenceSetsHook([ReferenceSet("old", [], [], 2)])
    resumed.load_state_dict(hook.state_dict())
    assert resumed.start == {"old": 1.0} and resumed.below == {"old": True} and resumed.last_step == 4
    task.clock.step = 4
    resumed.on_end(task)  # the last update was evaluated: nothing again
    assert len(resumed.history) == 5
    # from a random init (model.pretrained unset: the builder's warn=False) a fall is logged, never warned
    trunk.good, task.clock.step = True, 0
    fresh = ReferenceSetsHook([ReferenceSet("old", _batches(labels), _batches(labels[::-1]), 2)], every_n_steps=1,
                              k=3, warn_drop=0.2, warn=False)
    fresh.on_phase_start(task)
    trunk.good, task.clock.step = False, 1
    with caplog.at_level(logging.WARNING, logger="sslkit"):
        caplog.clear()
        fresh.on_update(task)
    assert not caplog.records and fresh.history[-1]["ref_old_drop"] == 0.5


def test_a_reference_set_without_labels_stops_the_command_before_the_run_folder(tmp_path: Path) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(4):
        Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(flat / f"{i}.png")
    out = tmp_path / "run"
    proc = run_main("config=simclr", *SMALL, *QUIET, f"output_dir={out}",
                    f"eval.reference.sets=[{{name: old, source: folder, path: {flat}, split: train}}]", check=False)
    assert proc.returncode == 2
    assert "eval.reference.sets[0] (old)" in proc.stderr + proc.stdout and "has no labels" in proc.stderr + proc.stdout
    assert not out.exists()


def test_a_set_of_the_training_source_reads_it_as_the_training_does() -> None:
    """A set naming no source reads its split as the run does, kwargs included (channels, size, count: the test
    split's ``data.test.kwargs``, the train split's ``data.train.kwargs``); a set that names kwargs keeps its own."""
    grey = "{channels: 1, image_size: 20, num_samples: 30}"
    cfg = compose_config(["config=simclr", *SMALL, "data.train.kwargs.channels=1", "data.train.kwargs.image_size=20",
                          f"data.test.kwargs={grey}", "data.image_size=16",
                          "eval.reference.sets=[{name: same, samples: 0}, {name: train, samples: 0, split: train}, "
                          "{name: own, samples: 0, kwargs: {channels: 1, image_size: 12, num_samples: 40}}]"])
    same, train, own = reference_sets(cfg)
    assert len(same[1]) + len(same[2]) == 30 and tuple(same[1][0][0].shape) == (1, 20, 20)
    assert len(train[1]) + len(train[2]) == 64 and tuple(train[1][0][0].shape) == (1, 20, 20)
    own_memory, own_queries = own[1], own[2]
    assert len(own_memory) + len(own_queries) == 40 and tuple(own_memory[0][0].shape) == (1, 12, 12)


def test_a_set_of_another_channel_count_stops_the_command_before_the_run_folder(tmp_path: Path) -> None:
    """RGB reference images for a trunk that reads grey ones would stop the run at its first evaluation with
    torch's shape error: the command stops first, naming the set and the kwargs that fix it."""
    out = tmp_path / "run"
    proc = run_main("config=simclr", *SMALL, *QUIET, "data.train.kwargs.channels=1", "data.test.kwargs.channels=1",
                    f"output_dir={out}",
                    "eval.reference.sets=[{name: rgb, source: synthetic, kwargs: {channels: 3}}]", check=False)
    said = proc.stderr + proc.stdout
    assert proc.returncode == 2, said
    assert "eval.reference.sets[0] (rgb)" in said and "3 channel(s) and the trunk reads 1" in said, said
    assert "kwargs: {channels: 1}" in said and "Traceback" not in said
    assert not out.exists()


def test_a_sets_kwargs_are_checked_against_its_sources_builder_before_anything_is_read() -> None:
    """A key its source's builder does not take is a config error naming the key and the nearest argument (it was a
    TypeError traceback at the first evaluation); a set without a source is checked against the run's."""
    from sslkit.config.schema import ConfigError
    from sslkit.config.validate import validate
    from sslkit.data.sources import build_fashion_mnist

    for sets, said in (("[{name: studio, source: fashion_mnist, kwargs: {chanels: 3}}]",
                        "'eval.reference.sets[0].kwargs.chanels' is not an argument of build_fashion_mnist. Did you "
                        "mean 'channels'?"),
                       ("[{name: a}, {name: b, kwargs: {image_sise: 8}}]",
                        "'eval.reference.sets[1].kwargs.image_sise' is not an argument of build_synthetic")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            validate(compose_config(["config=simclr", *SMALL, f"eval.reference.sets={sets}"]))
    validate(compose_config(["config=simclr", *SMALL, "eval.reference.sets=[{name: studio, source: fashion_mnist, "
                             "kwargs: {channels: 3, canvas: 32}}]"]))
    with pytest.raises(DataSourceError, match=re.escape("data.test.kwargs.canvas = 20: the side of the square")):
        build_fashion_mnist("test", canvas=20)
    with pytest.raises(DataSourceError, match=re.escape("data.test.kwargs.channels = 2: these images can be read")):
        build_fashion_mnist("test", channels=2)
