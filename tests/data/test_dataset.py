"""Tests for SSLDataset (seeded views, unreadable samples) and the loader (collation, workers)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sslkit.data import (
    DataSourceError,
    FolderDataset,
    SkippedSamples,
    SkipTotals,
    SSLDataset,
    StatefulDistributedSampler,
    TensorImageDataset,
    build_loader,
    build_source,
    build_transform,
    collate_views,
    mix_seed,
)


def same_image_source(n: int = 6) -> TensorImageDataset:
    """``n`` identical images, so any difference between samples comes from the augmentation seed."""
    img = torch.randint(0, 256, (1, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    return TensorImageDataset(img.repeat(n, 1, 1, 1), torch.arange(n) % 3, num_classes=3)


def simclr() -> object:
    return build_transform("simclr", image_size=12, blur_p=0.5)


def views_equal(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["views"], b["views"], strict=True))


def test_mix_seed_is_distinct_and_bounded() -> None:
    seeds = {mix_seed(s, e, i) for s in range(3) for e in range(10) for i in range(100)}
    assert len(seeds) == 3000 and all(0 <= x < 2**63 for x in seeds)
    assert mix_seed(1, 2, 3) != mix_seed(3, 2, 1) and mix_seed(0, 1) != mix_seed(0, 1, 0)


def test_views_depend_only_on_seed_epoch_index() -> None:
    ds = SSLDataset(same_image_source(), simclr(), seed=4)
    a = ds[(2, 3)]
    assert set(a) == {"views", "label", "index", "valid"}
    assert (a["label"], a["index"], a["valid"]) == (0, 3, True)
    assert views_equal(a, SSLDataset(same_image_source(), simclr(), seed=4)[(2, 3)])
    assert not views_equal(a, ds[(1, 3)])  # other epoch
    assert not views_equal(a, ds[(2, 4)])  # other index (same image)
    assert not views_equal(a, SSLDataset(same_image_source(), simclr(), seed=5)[(2, 3)])
    assert views_equal(ds[3], ds[(0, 3)])  # plain int key means epoch 0
    with pytest.raises(IndexError):
        ds[(0, 6)]


def test_main_process_rng_untouched() -> None:
    ds = SSLDataset(same_image_source(), simclr())
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    ds[(0, 1)]
    ds[(7, 2)]
    assert torch.equal(torch.rand(5), expected)


def write_tree(root: Path) -> None:
    """Samples (sorted): 0 a/good.png, 1 b/corrupt.jpg, 2 b/trunc.png, 3 c/good.jpg, 4 d/corrupt.jpg."""
    rng = np.random.default_rng(0)
    for name, color in (("a/good.png", (200, 10, 10)), ("c/good.jpg", (10, 200, 10))):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), color).save(root / name)
    (root / "b").mkdir()
    (root / "d").mkdir()
    (root / "b" / "corrupt.jpg").write_bytes(rng.integers(0, 256, 300, dtype=np.uint8).tobytes())
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(root / "b" / "trunc.png")
    data = (root / "b" / "trunc.png").read_bytes()
    (root / "b" / "trunc.png").write_bytes(data[: len(data) // 2])
    (root / "d" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0" + rng.integers(0, 256, 200, dtype=np.uint8).tobytes())


def test_unreadable_samples_are_substituted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_tree(tmp_path)
    source = build_source("folder", "train", str(tmp_path))
    ds = SSLDataset(source, build_transform("eval", image_size=8, mean=[0.0], std=[1.0]))
    with caplog.at_level(logging.WARNING, logger="sslkit.data"):
        good = ds[(0, 3)]
        corrupt = ds[(0, 1)]
        truncated = ds[(0, 2)]
        again = ds[(1, 1)]
        wrapped = ds[(0, 4)]
    assert good["valid"] and good["label"] == 2
    for sample, index in ((corrupt, 1), (truncated, 2), (again, 1)):
        assert not sample["valid"] and sample["index"] == index
        assert sample["label"] == 2  # the next readable sample, c/good.jpg
        assert torch.equal(sample["views"][0], good["views"][0])
    assert not wrapped["valid"] and wrapped["index"] == 4 and wrapped["label"] == 0  # wrapped to a/good.png
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3  # once per bad file, though b/corrupt.jpg was asked for twice
    assert any("corrupt.jpg" in w and "/b/" in w for w in warnings)
    assert any("trunc.png" in w for w in warnings)


def test_all_unreadable_raises(tmp_path: Path) -> None:
    for name in ("x.jpg", "y.png"):
        (tmp_path / name).write_bytes(b"definitely not an image")
    with pytest.raises(DataSourceError, match=r"no readable image in .*all 2 image files"):
        build_source("folder", "train", str(tmp_path))  # the folder source probes at build
    ds = SSLDataset(FolderDataset(tmp_path, channels=3, probe=0), build_transform("eval", image_size=8))
    for index in (1, 0):  # without the probe, the dataset itself stops
        with pytest.raises(DataSourceError, match="no readable image in 2 files") as info:
            ds[(0, index)]
        assert str(tmp_path) in str(info.value) and "cannot read image" in str(info.value)


def test_collate_views_shapes() -> None:
    ds = SSLDataset(same_image_source(), build_transform("simclr", image_size=12, num_views=3))
    batch = collate_views([ds[(0, i)] for i in range(4)])
    assert set(batch) == {"input", "target", "data_valid", "data_idx"}
    assert len(batch["input"]) == 3 and all(v.shape == (4, 3, 12, 12) for v in batch["input"])
    assert batch["target"].dtype == torch.int64 and batch["target"].tolist() == [0, 1, 2, 0]
    assert batch["data_valid"].dtype == torch.bool and batch["data_valid"].all()
    assert batch["data_idx"].tolist() == [0, 1, 2, 3]
    bad = ds[(0, 5)]
    bad["views"] = bad["views"][:1]
    with pytest.raises(ValueError, match="numbers of views"):
        collate_views([ds[(0, 0)], bad])


def loader_batches(num_workers: int, epoch: int) -> list[dict]:
    source = build_source("synthetic", "train", None, num_samples=40, image_size=10, num_classes=4)
    ds = SSLDataset(source, build_transform("simclr", image_size=8, blur_p=0.5), seed=1)
    sampler = StatefulDistributedSampler(len(ds), num_replicas=2, rank=1, seed=1)
    sampler.set_epoch(epoch)
    kwargs = {"prefetch_factor": 2, "persistent_workers": False} if num_workers else {}
    loader = build_loader(ds, batch_size=6, sampler=sampler, num_workers=num_workers, **kwargs)
    return list(loader)


def test_loader_workers_do_not_change_batches() -> None:
    serial = loader_batches(0, epoch=2)
    parallel = loader_batches(2, epoch=2)
    assert len(serial) == len(parallel) == 3  # 20 samples for this rank, drop_last
    for a, b in zip(serial, parallel, strict=True):
        assert torch.equal(a["data_idx"], b["data_idx"]) and torch.equal(a["target"], b["target"])
        assert all(torch.equal(x, y) for x, y in zip(a["input"], b["input"], strict=True))
        assert a["input"][0].shape == (6, 3, 8, 8)
    other_epoch = loader_batches(0, epoch=3)
    assert not torch.equal(serial[0]["data_idx"], other_epoch[0]["data_idx"])


def test_loader_without_workers_ignores_worker_options() -> None:
    ds = SSLDataset(same_image_source(), build_transform("eval", image_size=16))
    sampler = StatefulDistributedSampler(len(ds), shuffle=False)
    loader = build_loader(ds, 4, sampler, num_workers=0, persistent_workers=True, prefetch_factor=4, drop_last=False)
    assert [b["data_idx"].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5]]


# --- counting skipped samples per epoch -----------------------------------------------------------


def write_half_broken(root: Path) -> None:
    """Samples (sorted): 0-3 readable (a*.png), 4-7 unreadable (b*.jpg), so batch 2 of 4 is all bad."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(4):
        Image.new("RGB", (8, 8), (10 * i, 0, 0)).save(root / f"a{i}.png")
        (root / f"b{i}.jpg").write_bytes(b"\xff\xd8\xff\xe0" + bytes(40))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skipped_samples_counted_in_main_process(tmp_path: Path, num_workers: int,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    write_half_broken(tmp_path)
    ds = SSLDataset(build_source("folder", "train", str(tmp_path)), build_transform("eval", image_size=8))
    sampler = StatefulDistributedSampler(len(ds), shuffle=False)
    loader = build_loader(ds, 4, sampler, num_workers=num_workers, drop_last=False)
    counter = SkippedSamples()
    for epoch in (0, 1):
        counter.reset()
        sampler.set_epoch(epoch)
        batches = list(loader)
        for batch in batches:
            counter.update(batch)
        assert [b["data_valid"].tolist() for b in batches] == [[True] * 4, [False] * 4]
        assert counter.totals(across_ranks=False) == SkipTotals(skipped=4, seen=8, empty_batches=1)
        report = counter.report(epoch)
        assert report is not None and report.startswith(f"epoch {epoch}: 4 of 8 samples (50.00%) were unreadable")
        assert "1 batch had no readable sample" in report
        counter.check_all_unreadable(epoch)  # half was readable: no error


def test_skipped_samples_all_unreadable_epoch_raises() -> None:
    counter = SkippedSamples()
    counter.update({"data_valid": torch.tensor([False, False, False])})
    counter.update({"data_valid": torch.tensor([False])})
    assert counter.totals() == SkipTotals(4, 4, 2)
    assert "2 batches had no readable sample" in (counter.report(5) or "")
    with pytest.raises(DataSourceError, match="epoch 5: all 4 samples were unreadable"):
        counter.check_all_unreadable(5)
    counter.reset()
    counter.check_all_unreadable(6)  # nothing seen: nothing to complain about


def test_skipped_samples_clean_epoch_and_batches_without_flags() -> None:
    counter = SkippedSamples()
    counter.update({"data_valid": torch.tensor([True, True])})
    counter.update({"input": [torch.zeros(2, 3)]})  # no data_valid: counts as readable, not seen
    counter.update(torch.tensor([True]))  # the flag tensor itself
    assert counter.totals() == SkipTotals(0, 3, 0)
    assert counter.report(0) is None


def test_skipped_samples_update_never_reads_the_device() -> None:
    # On the meta device a tensor has no data: any .item() / .tolist() / bool() in update would raise.
    counter = SkippedSamples("meta")
    for _ in range(3):
        counter.update({"data_valid": torch.ones(4, dtype=torch.bool, device="meta")})
    assert counter.counts.device.type == "meta" and counter.counts.shape == (3,)


def test_skipped_samples_follow_batch_device_and_state_roundtrip() -> None:
    counter = SkippedSamples()  # no device given: the first batch's
    counter.update(torch.tensor([True, False]))
    state = counter.state_dict()
    assert state == {"counts": [1, 2, 0]}
    fresh = SkippedSamples()
    fresh.load_state_dict(state)
    fresh.update(torch.tensor([False]))
    assert fresh.totals() == SkipTotals(2, 3, 1)
    counter.reset()
    assert counter.totals() == SkipTotals(0, 0, 0)


def test_a_process_exits_with_a_worker_iterator_left_alive(tmp_path) -> None:
    """Workers ignore SIGTERM (the pre-emption signals); an iterator kept alive by a reference cycle at exit is
    still shut down, so the interpreter ends instead of waiting for its workers forever."""
    import subprocess
    import sys

    from helpers import HANG_S, REPO

    script = tmp_path / "leak.py"
    script.write_text(
        "import signal, torch\n"
        "from sslkit.data import SSLDataset, StatefulDistributedSampler, build_loader\n"
        "from sslkit.data.sources import build_synthetic\n"
        "ds = SSLDataset(build_synthetic('train', num_samples=64, image_size=8), lambda x: [x.float()])\n"
        "loader = build_loader(ds, 4, StatefulDistributedSampler(64, 1, 0), num_workers=1, persistent_workers=True,\n"
        "                      worker_ignores=(int(signal.SIGTERM), int(signal.SIGINT)))\n"
        "class Holder: pass\n"
        "h = Holder(); h.it = iter(loader); h.me = h; next(h.it)\n"
        "del h, loader\n"
        "print('done', flush=True)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=HANG_S,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
