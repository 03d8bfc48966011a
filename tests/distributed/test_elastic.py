"""Elastic exact resume: with data.global_batch_size, a run resumed on another number of processes reads the same
images at every step as the uninterrupted run, and ends at its weights up to the order of the reductions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_workers import elastic_steps
from helpers import RECIPES, SMALL

pytestmark = pytest.mark.multiprocess

#: dinov2 (masks per sample, all-reduced Sinkhorn-Knopp sums, KoLeo over the global batch, a teacher) with a global
#: batch of 32 on 128 images: 4 steps per epoch, 2 epochs; plain SGD, so the weights compare the gradients; no drop
#: path (it draws from each process's own generator, so N processes follow its distribution, not its values).
ARGS = ["config=dinov2", *SMALL, *RECIPES["dinov2"], "data.global_batch_size=32", "data.train.kwargs.num_samples=128",
        "optim.epochs=2", "model.trunk_kwargs.drop_path_rate=0.0", "optim.name=sgd", "optim.momentum=0.0",
        "optim.weight_decay=0.0", "optim.final_weight_decay=null", "optim.lr=0.05", "optim.lr_scaling=none",
        "checkpoint.every_n_steps=3", "checkpoint.every_n_epochs=0", "checkpoint.keep_last=0",
        "eval.knn.enabled=false", "log.tensorboard=false", "imports=[sslkit_faults]"]


def _model(out: Path) -> dict[str, torch.Tensor]:
    from reliability_helpers import latest_state

    state = latest_state(out)
    assert state["position"]["step"] == 8
    return state["model"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_on_one_and_on_four_processes_reads_the_same_images_and_ends_at_the_same_weights(
        tmp_path: Path, strategy: str) -> None:
    """A 2-process run crashed after step 5 (checkpoint at step 3) is resumed on 1 process (batch 32) and on 4
    (batch 8): steps 3-7 read exactly the images of the uninterrupted 2-process run's steps 3-7, each step the same
    32, and the weights after step 8 agree with its weights within float32 reduction order: measured max difference
    1.5e-8 (1 process) and 1.9e-8 (4 processes) under ddp, tolerance 5e-6, as for 1 against 2 processes. Under fsdp
    the checkpoints are sharded folders (2 files), read back resharded into 4 processes and whole into one."""
    args = [*ARGS, f"distributed.strategy={strategy}"]
    expected, resumed = elastic_steps(args, tmp_path)
    crashed, ref = tmp_path / "crashed", tmp_path / "ref"
    sharded = sorted(p.name for p in (crashed / "checkpoints" / "checkpoint_000000003").glob("*")) if strategy == \
        "fsdp" else None
    assert sharded in (None, [".metadata", "__0_0.distcp", "__1_0.distcp"]), sharded
    assert sorted(expected) == list(range(8)) and all(len(v) == 32 for v in expected.values())
    assert sorted(i for step in range(4) for i in expected[step]) == list(range(128))  # epoch 0: each image once
    for world, got in resumed.items():
        assert sorted(got) == [3, 4, 5, 6, 7], sorted(got)
        for step, indices in got.items():
            assert indices == expected[step], (world, step)
        out = tmp_path / f"on{world}"
        worst = max((a.double() - b.double()).abs().max().item()
                    for a, b in zip(_model(out).values(), _model(ref).values(), strict=True))
        print(f"resumed on {world} process(es): max |weights - uninterrupted 2-process run's| = {worst:.2e}")
        assert worst < 5e-6, (world, worst)
