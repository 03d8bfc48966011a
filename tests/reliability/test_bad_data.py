"""Bad input through tools/run.py: corrupt images are skipped and reported; a truncated checkpoint falls back."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import metrics, run_main
from PIL import Image
from reliability_helpers import BASE, assert_identical, latest_state

SMALL_FOLDER = ["config=simclr", "machine.device=cpu", "data=folder", "data.batch_size=8", "data.num_workers=0",
                "model.trunk=small_cnn",
                "model.trunk_kwargs={width: 8}", "model.head.hidden_dim=32", "model.head.out_dim=16",
                "data.image_size=24", "data.small_image_size=12", "data.eval_transform.resize=28",
                "eval.knn.enabled=false", "log.tensorboard=false",
                "optim.epochs=2", "log.every_n_steps=1"]


def _image_bytes(rng: np.random.Generator, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.slow
def test_corrupt_jpeg_and_png_are_skipped_counted_and_reported_each_epoch(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    root = tmp_path / "train"
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(16):
            fmt = "JPEG" if i % 2 else "PNG"
            (root / cls / f"{i:02d}.{fmt.lower().replace('jpeg', 'jpg')}").write_bytes(_image_bytes(rng, fmt))
    good_jpg = _image_bytes(rng, "JPEG")
    (root / "a" / "trunc.jpg").write_bytes(good_jpg[: len(good_jpg) // 3])             # truncated JPEG
    (root / "b" / "garbage.png").write_bytes(b"\x89PNG\r\n\x1a\n" + rng.bytes(200))   # PNG header, junk after
    (root / "b" / "notes.txt").write_text("not an image")                            # ignored
    out = tmp_path / "run"
    proc = run_main(*SMALL_FOLDER, f"data.train.path={root}", f"output_dir={out}")
    log = proc.stdout + proc.stderr
    assert "trunc.jpg" in log and "garbage.png" in log  # each bad file is named
    reports = [r for r in metrics(out) if "unreadable_samples" in r]
    # 34 images, 4 batches of 8 per epoch (drop_last): 32 samples seen, of which the bad ones drawn
    assert [r["epoch"] for r in reports] == [0, 1]
    for r in reports:
        assert r["samples"] == 32 and 1 <= r["unreadable_samples"] <= 2
    assert "unreadable" in log and "epoch 0:" in log
    assert latest_state(out)["position"]["step"] == 8


@pytest.mark.slow
def test_truncated_latest_checkpoint_falls_back_and_the_run_ends_identical(tmp_path: Path) -> None:
    args = ["config=simclr", *BASE, "optim.epochs=2", "checkpoint.every_n_steps=4"]
    run_main(*args, f"output_dir={tmp_path / 'ref'}")
    reference = latest_state(tmp_path / "ref")

    out = tmp_path / "run"
    shutil.copytree(tmp_path / "ref", out)
    ckpts = out / "checkpoints"
    latest = ckpts / (ckpts / "latest.txt").read_text().strip()
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # torn by a crash or a full disk
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in metrics(out) if r.get("step", 0) <= 8))
    proc = run_main(*args, f"output_dir={out}")
    assert "is unreadable" in proc.stdout + proc.stderr and "checkpoint_000000008.pt" in proc.stdout
    assert_identical(latest_state(out), reference)
