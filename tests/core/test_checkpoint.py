"""Checkpoint files: atomic write, latest pointer, keep-last-N, fallback from a corrupt latest."""

from __future__ import annotations

import os

import pytest
import torch

from sslkit.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint


def test_save_load_roundtrip_and_pointer(tmp_path) -> None:
    d = str(tmp_path / "ckpt")
    save_checkpoint({"x": torch.tensor([1.0])}, d, 10)
    path = save_checkpoint({"x": torch.tensor([2.0])}, d, 20)
    assert latest_checkpoint(d) == path
    state, loaded = load_checkpoint(d)
    assert loaded == path and torch.equal(state["x"], torch.tensor([2.0]))
    assert not [f for f in os.listdir(d) if ".tmp." in f]


def test_keep_last(tmp_path) -> None:
    d = str(tmp_path)
    for i in range(5):
        save_checkpoint({"i": i}, d, i, keep_last=2)
    kept = sorted(f for f in os.listdir(d) if f.endswith(".pt"))
    assert kept == ["checkpoint_000000003.pt", "checkpoint_000000004.pt"]


def test_truncated_latest_falls_back_to_previous(tmp_path, caplog) -> None:
    d = str(tmp_path)
    save_checkpoint({"i": 1}, d, 1)
    path = save_checkpoint({"i": 2}, d, 2)
    with open(path, "r+b") as f:
        f.truncate(10)
    state, loaded = load_checkpoint(d)
    assert state["i"] == 1 and loaded.endswith("checkpoint_000000001.pt")
    assert "unreadable" in caplog.text


def test_no_checkpoint_returns_none_and_all_corrupt_raises(tmp_path) -> None:
    assert load_checkpoint(str(tmp_path / "none")) is None
    d = str(tmp_path / "bad")
    path = save_checkpoint({"i": 1}, d, 1)
    with open(path, "wb") as f:
        f.write(b"garbage")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* can be read \(1 tried.*auto_resume=false"):
        load_checkpoint(d)
