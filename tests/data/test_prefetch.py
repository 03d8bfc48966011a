"""The prefetcher hands over each batch prepared one call earlier, with its position, and ends with the data."""

from __future__ import annotations

import pytest
import torch

from sslkit.data.prefetch import Prefetcher
from sslkit.registry import register_train_step
from sslkit.train_steps import stages


def test_batches_are_prepared_one_ahead_and_counted() -> None:
    calls: list[int] = []

    def prepare(batch: int) -> dict:
        calls.append(batch)
        return {"input": [torch.full((2,), float(batch))]}

    prefetcher = Prefetcher(iter([10, 11, 12]), prepare, torch.device("cpu"), start=5)
    assert calls == []  # nothing is read before the first batch is asked for
    first = next(prefetcher)
    assert prefetcher.position == 6 and first["input"][0].tolist() == [10.0, 10.0]
    assert calls == [10, 11]  # the next batch is already prepared while this one is used
    assert [s["input"][0][0].item() for s in prefetcher] == [11.0, 12.0]
    assert prefetcher.position == 8 and calls == [10, 11, 12]
    with pytest.raises(StopIteration):
        next(prefetcher)


@register_train_step("greedy_reader_test_step")
def greedy_step(task) -> None:
    """Reads a batch of its own before the standard micro-batches: one read too many."""
    stages.read_sample(task)
    stages.update(task, stages.run_micro_batches(task, stages.forward_backward))


def test_a_custom_step_that_reads_out_of_step_is_told(tmp_path) -> None:
    """A step that reads two batches per micro-batch would draw other augmentations than a resume computes: the
    second read names the problem."""
    from helpers import SMALL, run_main

    with pytest.raises(RuntimeError, match="read out of step"):
        run_main(*SMALL, "config=simclr", "train_step=greedy_reader_test_step", "optim.max_steps=2",
                 "eval.knn.enabled=false", f"output_dir={tmp_path / 'run'}", check=False)
