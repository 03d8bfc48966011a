"""Checkpoint files: atomic write, latest pointer, keep-last-N, fallback from a corrupt latest."""

from __future__ import annotations

import os

import pytest
import torch

from sslkit.checkpoint import Checkpointer, CheckpointError, save_checkpoint


def test_save_load_roundtrip_and_pointer(tmp_path) -> None:
    d = str(tmp_path / "checkpoints")
    save_checkpoint({"x": torch.tensor([1.0])}, d, 10)
    path = save_checkpoint({"x": torch.tensor([2.0])}, d, 20)
    assert Checkpointer(str(tmp_path)).latest() == path
    state, loaded = Checkpointer(str(tmp_path)).read_latest()
    assert loaded == path and torch.equal(state["x"], torch.tensor([2.0]))
    assert not [f for f in os.listdir(d) if ".tmp." in f]


def test_keep_last(tmp_path) -> None:
    d = str(tmp_path)
    for i in range(5):
        save_checkpoint({"i": i}, d, i, keep_last=2)
    kept = sorted(f for f in os.listdir(d) if f.endswith(".pt"))
    assert kept == ["checkpoint_000000003.pt", "checkpoint_000000004.pt"]


def test_truncated_latest_falls_back_to_previous(tmp_path, caplog) -> None:
    d = str(tmp_path / "checkpoints")
    save_checkpoint({"i": 1}, d, 1)
    path = save_checkpoint({"i": 2}, d, 2)
    with open(path, "r+b") as f:
        f.truncate(10)
    state, loaded = Checkpointer(str(tmp_path)).read_latest()
    assert state["i"] == 1 and loaded.endswith("checkpoint_000000001.pt")
    assert "unreadable" in caplog.text


def test_no_checkpoint_returns_none_and_all_corrupt_raises(tmp_path) -> None:
    assert Checkpointer(str(tmp_path / "none")).read_latest() is None
    path = save_checkpoint({"i": 1}, str(tmp_path / "bad" / "checkpoints"), 1)
    with open(path, "wb") as f:
        f.write(b"garbage")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* can be read \(1 tried.*auto_resume=false"):
        Checkpointer(str(tmp_path / "bad")).read_latest()


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path) -> None:
    """A checkpoint file carrying a pickled call (here: create a file) is refused by name, and the call never
    runs; the run's own checkpoints, numpy RNG state included, load with weights_only=True."""
    import glob

    from helpers import SMALL, run_main


    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    run_main(*SMALL, "config=simclr", "optim.max_steps=2", "eval.knn.enabled=false", f"output_dir={tmp_path / 'run'}")
    ckpts = tmp_path / "run" / "checkpoints"
    good = sorted(glob.glob(str(ckpts / "checkpoint_*.pt")))[-1]
    state = torch.load(good, weights_only=True)  # plain torch, the safe way: no error
    assert isinstance(state["rng"][0]["numpy"][1], torch.Tensor)
    evil = ckpts / "checkpoint_000000099.pt"
    torch.save({**state, "extra": Payload()}, evil)
    (ckpts / "latest.txt").write_text(evil.name)
    with pytest.raises(CheckpointError, match=r"holds .*open.*which loading would call"):
        Checkpointer(str(tmp_path / "run")).read_latest()
    with pytest.raises(CheckpointError):
        Checkpointer.read(str(evil))
    assert not marker.exists()
    proc = run_main(*SMALL, "config=simclr", "optim.max_steps=4", "eval.knn.enabled=false",
                    f"output_dir={tmp_path / 'run'}", check=False)
    assert proc.returncode != 0 and "which loading would call" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()


def test_numpy_rng_state_round_trips_through_the_plain_form() -> None:
    """The numpy RNG state is stored as a tensor (a checkpoint holds no numpy object) and restored exactly (the next
    draws are the same)."""
    import numpy as np

    from sslkit.checkpointing.state import rng_state, set_rng_state

    np.random.seed(3)
    np.random.standard_normal()  # a cached gaussian in the state too
    state = rng_state()
    expected = np.random.random(5)
    set_rng_state(state)
    assert np.array_equal(np.random.random(5), expected)
    assert isinstance(state["numpy"][1], torch.Tensor)
