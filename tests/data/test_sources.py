"""Tests for the data sources: idx parsing, Fashion-MNIST lookup, CIFAR, folders, synthetic."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sslkit.data import sources
from sslkit.data.sources import DataSourceError, UnreadableSampleError, build_source, read_idx
from sslkit.registry import UnknownNameError


def write_idx(path: Path, arr: np.ndarray) -> Path:
    """Write a uint8 array as an idx file (gzip-compressed when ``path`` ends in .gz)."""
    header = bytes([0, 0, 0x08, arr.ndim]) + np.asarray(arr.shape, dtype=">u4").tobytes()
    data = header + np.ascontiguousarray(arr, dtype=np.uint8).tobytes()
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def write_fashion(folder: Path, prefix: str, n: int, gz: bool, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    folder.mkdir(parents=True, exist_ok=True)
    images = ((np.arange(n * 28 * 28).reshape(n, 28, 28) + offset) % 251).astype(np.uint8)
    labels = (np.arange(n) * 3 % 10).astype(np.uint8)
    ext = ".gz" if gz else ""
    write_idx(folder / f"{prefix}-images-idx3-ubyte{ext}", images)
    write_idx(folder / f"{prefix}-labels-idx1-ubyte{ext}", labels)
    return images, labels


@pytest.fixture
def no_fallbacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[str, bool]]:
    """Point the Debian folder nowhere and make the torchvision download fail (no network in tests)."""
    calls: list[tuple[str, bool]] = []

    def fail(root: str, train: bool) -> None:
        calls.append((root, train))
        raise RuntimeError("network disabled in tests")

    monkeypatch.setattr(sources, "DEBIAN_FASHION_MNIST", str(tmp_path / "no-debian"))
    monkeypatch.setattr(sources, "_torchvision_fashion_mnist", fail)
    monkeypatch.setenv("SSLKIT_CACHE_DIR", str(tmp_path / "cache"))
    return calls


# --- idx / Fashion-MNIST ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["x-idx3-ubyte", "x-idx3-ubyte.gz"])
def test_read_idx_roundtrip(tmp_path: Path, name: str) -> None:
    arr = np.random.default_rng(0).integers(0, 256, size=(5, 4, 3), dtype=np.uint8)
    out = read_idx(write_idx(tmp_path / name, arr))
    assert out.shape == (5, 4, 3)
    np.testing.assert_array_equal(out, arr)


def test_read_idx_rejects_bad_files(tmp_path: Path) -> None:
    (tmp_path / "bad").write_bytes(b"\x12\x34\x08\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="magic"):
        read_idx(tmp_path / "bad")
    good = write_idx(tmp_path / "short", np.zeros((4, 2), np.uint8))
    good.write_bytes(good.read_bytes()[:-1])
    with pytest.raises(ValueError, match="bytes"):
        read_idx(good)


def test_fashion_mnist_from_path_gz_and_plain(tmp_path: Path, no_fallbacks: list) -> None:
    tr_img, tr_lbl = write_fashion(tmp_path, "train", 7, gz=True)
    te_img, te_lbl = write_fashion(tmp_path, "t10k", 3, gz=False, offset=5)
    train = build_source("fashion_mnist", "train", str(tmp_path))
    test = build_source("fashion_mnist", "test", str(tmp_path))
    assert (len(train), len(test)) == (7, 3)
    assert (train.num_classes, train.channels) == (10, 1)
    assert train.images.shape == (7, 1, 28, 28) and train.images.dtype == torch.uint8
    for ds, img, lbl in ((train, tr_img, tr_lbl), (test, te_img, te_lbl)):
        for i in range(len(ds)):
            x, y = ds[i]
            assert x.dtype == torch.uint8 and x.shape == (1, 28, 28)
            np.testing.assert_array_equal(x[0].numpy(), img[i])
            assert y == int(lbl[i]) and isinstance(y, int)
    assert not no_fallbacks  # found in path: torchvision never asked


def test_fashion_mnist_item_is_a_copy(tmp_path: Path, no_fallbacks: list) -> None:
    write_fashion(tmp_path, "train", 2, gz=False)
    ds = build_source("fashion_mnist", "train", str(tmp_path))
    x, _ = ds[0]
    x.zero_()
    assert ds[0][0].any()


def test_fashion_mnist_accepts_torchvision_root(tmp_path: Path, no_fallbacks: list) -> None:
    write_fashion(tmp_path / "FashionMNIST" / "raw", "train", 4, gz=False)
    assert len(build_source("fashion_mnist", "train", str(tmp_path))) == 4


def test_fashion_mnist_explicit_path_is_the_only_place_looked_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_fallbacks: list
) -> None:
    """A path the user set is never silently replaced by the system copy: a bad file there or a missing folder
    is an error naming it, even with a good copy in the Debian folder."""
    user = tmp_path / "user"
    write_fashion(user, "train", 4, gz=False)
    (user / "train-images-idx3-ubyte").write_bytes(b"garbage")
    debian = tmp_path / "debian"
    write_fashion(debian, "train", 6, gz=True)
    monkeypatch.setattr(sources, "DEBIAN_FASHION_MNIST", str(debian))
    with pytest.raises(DataSourceError, match=rf"data path {user}: .*not an idx file"):
        build_source("fashion_mnist", "train", str(user))
    with pytest.raises(DataSourceError, match=r"data.train.path = .*fashon does not exist"):
        build_source("fashion_mnist", "train", str(tmp_path / "fashon"))
    assert len(build_source("fashion_mnist", "train", None)) == 6  # unset: the system copy


def test_fashion_mnist_falls_back_to_torchvision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "DEBIAN_FASHION_MNIST", str(tmp_path / "none"))
    seen = {}

    def fake(root: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        seen.update(root=root, train=train)
        return torch.full((5, 1, 28, 28), 7, dtype=torch.uint8), torch.arange(5)

    monkeypatch.setattr(sources, "_torchvision_fashion_mnist", fake)
    (tmp_path / "dl").mkdir()  # a folder to download into must exist: a missing one is taken for a typo
    ds = build_source("fashion_mnist", "test", str(tmp_path / "dl"))
    assert len(ds) == 5 and ds[3][1] == 3 and int(ds[3][0].max()) == 7
    assert seen == {"root": str(tmp_path / "dl"), "train": False}


def test_fashion_mnist_missing_everywhere_names_all_places(tmp_path: Path, no_fallbacks: list) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataSourceError) as info:
        build_source("fashion_mnist", "train", str(empty))
    msg = str(info.value)
    assert str(empty) in msg
    assert str(tmp_path / "no-debian") in msg
    assert "torchvision download" in msg and "network disabled" in msg
    assert "apt-get install dataset-fashion-mnist" in msg and "data.train.path" in msg
    assert no_fallbacks == [(str(empty), True)]

    with pytest.raises(DataSourceError) as info:
        build_source("fashion_mnist", "test", None)
    msg = str(info.value)
    assert "not set" in msg and str(tmp_path / "cache" / "fashion_mnist") in msg and "data.test.path" in msg


def test_fashion_mnist_download_false_skips_torchvision(tmp_path: Path, no_fallbacks: list) -> None:
    with pytest.raises(DataSourceError, match="download=False"):
        build_source("fashion_mnist", "train", str(tmp_path), download=False)
    assert not no_fallbacks


@pytest.mark.skipif(
    not Path(sources.DEBIAN_FASHION_MNIST, "train-images-idx3-ubyte.gz").exists(),
    reason="Debian package dataset-fashion-mnist not installed",
)
def test_fashion_mnist_debian_copy() -> None:
    train = build_source("fashion_mnist", "train", None)
    test = build_source("fashion_mnist", "test", None)
    assert (len(train), len(test)) == (60000, 10000)
    assert train.images.shape == (60000, 1, 28, 28)
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    assert train[0][1] == 9  # the first training image is an ankle boot


def test_bad_split_rejected() -> None:
    with pytest.raises(ValueError, match="split"):
        build_source("synthetic", "val", None)


def test_unknown_source_suggests_closest() -> None:
    with pytest.raises(UnknownNameError, match="fashion_mnist"):
        build_source("fashon_mnist", "train", None)


# --- CIFAR --------------------------------------------------------------------------------------


def test_cifar_converts_hwc_to_chw_after_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    data = np.random.default_rng(0).integers(0, 256, size=(4, 32, 32, 3), dtype=np.uint8)

    def fake(name: str, root: str, train: bool, download: bool) -> tuple[np.ndarray, list[int]]:
        calls.append((name, root, train, download))
        if not download:
            raise RuntimeError("Dataset not found or corrupted")
        return data, [3, 1, 4, 1]

    monkeypatch.setattr(sources, "_torchvision_cifar", fake)
    ds = build_source("cifar100", "train", str(tmp_path))
    assert calls == [("cifar100", str(tmp_path), True, False), ("cifar100", str(tmp_path), True, True)]
    assert (len(ds), ds.num_classes, ds.channels) == (4, 100, 3)
    x, y = ds[2]
    assert x.shape == (3, 32, 32) and x.dtype == torch.uint8 and y == 4
    torch.testing.assert_close(x, torch.from_numpy(data[2]).permute(2, 0, 1))


def test_cifar_failure_names_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fail(name: str, root: str, train: bool, download: bool) -> None:
        calls.append(download)
        raise RuntimeError("offline")

    monkeypatch.setattr(sources, "_torchvision_cifar", fail)
    with pytest.raises(DataSourceError, match="offline") as info:
        build_source("cifar10", "test", str(tmp_path / "c10"))
    assert str(tmp_path / "c10") in str(info.value)
    assert calls == [False, True]
    calls.clear()
    with pytest.raises(DataSourceError):
        build_source("cifar10", "test", str(tmp_path / "c10"), download=False)
    assert calls == [False]


# --- folders ------------------------------------------------------------------------------------


def save(path: Path, color: tuple[int, int, int], size: tuple[int, int] = (6, 4)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def test_image_folder_tree(tmp_path: Path) -> None:
    save(tmp_path / "dog" / "a.png", (255, 0, 0))
    save(tmp_path / "dog" / "deeper" / "b.JPG", (0, 255, 0))
    save(tmp_path / "cat" / "c.PNG", (0, 0, 255))
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    (tmp_path / "empty_class").mkdir()
    ds = build_source("folder", "train", str(tmp_path))
    assert ds.classes == ["cat", "dog"] and ds.num_classes == 2 and ds.channels == 3
    assert [Path(p).name for p, _ in ds.samples] == ["c.PNG", "a.png", "b.JPG"]
    assert [y for _, y in ds.samples] == [0, 1, 1]
    x, y = ds[0]
    assert x.shape == (3, 4, 6) and x.dtype == torch.uint8 and y == 0
    assert x[:, 0, 0].tolist() == [0, 0, 255]
    jpeg, _ = ds[2]
    assert abs(int(jpeg[1, 2, 3]) - 255) < 8 and int(jpeg[0, 2, 3]) < 8  # lossy but green


def test_flat_folder_and_grayscale(tmp_path: Path) -> None:
    save(tmp_path / "x.png", (255, 255, 255))
    save(tmp_path / "y.jpeg", (0, 0, 0))
    ds = build_source("folder", "test", str(tmp_path), channels=1)
    assert (len(ds), ds.num_classes, ds.channels) == (2, 0, 1)
    x, y = ds[0]
    assert x.shape == (1, 4, 6) and y == -1 and int(x.min()) == 255


def test_folder_corrupt_file_raises_unreadable(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8).tobytes())
    save(tmp_path / "good.png", (1, 2, 3))
    ds = build_source("folder", "train", str(tmp_path))
    with pytest.raises(UnreadableSampleError, match=r"bad\.jpg") as info:
        ds[0]
    assert info.value.path == str(bad)


@pytest.mark.parametrize("case", ["missing", "empty", "no_images", "no_path", "a_file"])
def test_folder_errors(tmp_path: Path, case: str) -> None:
    path: str | None = str(tmp_path / "data")
    if case == "empty":
        (tmp_path / "data").mkdir()
    elif case == "no_images":
        (tmp_path / "data" / "sub").mkdir(parents=True)
        (tmp_path / "data" / "readme.txt").write_text("hi")
        (tmp_path / "data" / "sub" / "x.gif").write_bytes(b"GIF89a")
        (tmp_path / "data" / ".DS_Store").write_bytes(b"hidden: neither read nor counted")
    elif case == "a_file":
        path = str(save(tmp_path / "data.png", (1, 2, 3)))
    elif case == "no_path":
        path = None
    with pytest.raises(DataSourceError) as info:
        build_source("folder", "train", path)
    msg = str(info.value)
    if case == "missing":
        assert "does not exist" in msg and str(tmp_path / "data") in msg and "data.train.path" in msg
    elif case == "no_path":
        assert "data.train.path" in msg
    elif case == "a_file":
        assert "is a file, not a folder" in msg and "data.png" in msg and "data.train.path" in msg
    else:
        assert "no image files" in msg and ".jpg" in msg and ".webp" in msg and "data.train.path" in msg
        if case == "empty":
            assert "the folder is empty" in msg
        else:
            assert "found only 2 other files (.gif: 1, .txt: 1)" in msg


def write_bad_images(folder: Path) -> list[Path]:
    """Five files that end in an image extension but cannot be decoded, each broken differently."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    noise = Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8))
    files = []
    for name, fmt in (("trunc.jpg", "JPEG"), ("trunc.png", "PNG")):  # real PIL output, cut in half
        noise.save(folder / name, format=fmt)
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2])
        files.append(folder / name)
    (folder / "header.jpg").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + rng.bytes(300))  # JPEG header, garbage
    (folder / "header.png").write_bytes(b"\x89PNG\r\n\x1a\n" + rng.bytes(300))  # PNG signature, garbage
    (folder / "notes.jpg").write_text("a text file with an image extension")
    return [*files, folder / "header.jpg", folder / "header.png", folder / "notes.jpg"]


def test_each_kind_of_bad_file_is_unreadable(tmp_path: Path) -> None:
    bad = write_bad_images(tmp_path)
    save(tmp_path / "zz_good.png", (9, 9, 9))
    ds = build_source("folder", "train", str(tmp_path))
    assert len(ds) == 6
    for i, (path, _) in enumerate(ds.samples[:5]):
        with pytest.raises(UnreadableSampleError) as info:
            ds[i]
        assert info.value.path == path and Path(path).name in str(info.value)
    assert sorted(Path(p) for p, _ in ds.samples[:5]) == sorted(bad)
    assert ds[5][0][:, 0, 0].tolist() == [9, 9, 9]


def test_folder_where_nothing_can_be_read_stops_at_build(tmp_path: Path) -> None:
    write_bad_images(tmp_path / "cls")
    (tmp_path / "notes.txt").write_text("ignored: not an image extension")
    with pytest.raises(DataSourceError) as info:
        build_source("folder", "train", str(tmp_path))
    msg = str(info.value)
    assert f"no readable image in {tmp_path}" in msg and "all 5 image files" in msg
    assert "cannot read image" in msg and "trunc" in msg  # an example error with its file
    assert "data.train.path" in msg


def test_probe_of_a_large_broken_folder_tries_a_spread_of_files(tmp_path: Path) -> None:
    for i in range(40):
        (tmp_path / f"{i:02d}.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(50))
    with pytest.raises(DataSourceError, match=r"the 32 image files tried \(spread over all 40\)"):
        build_source("folder", "train", str(tmp_path))
    assert len(sources.FolderDataset(tmp_path, channels=3, probe=0)) == 40  # probe=0, a count: no decoding at build


def test_probe_stops_at_the_first_readable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_bad_images(tmp_path)
    save(tmp_path / "zz_good.png", (9, 9, 9))
    calls: list[int] = []
    original = sources.FolderDataset.__getitem__

    def counting(self: sources.FolderDataset, i: int) -> tuple[torch.Tensor, int]:
        calls.append(i)
        return original(self, i)

    monkeypatch.setattr(sources.FolderDataset, "__getitem__", counting)
    build_source("folder", "train", str(tmp_path))
    assert calls == [0, 1, 2, 3, 4, 5]  # five bad files in name order, then the good one: stop
    calls.clear()
    for name in ("a.png", "b.png", "c.png"):
        save(tmp_path / "healthy" / name, (1, 1, 1))
    build_source("folder", "train", str(tmp_path / "healthy"))
    assert calls == [0]


def test_non_image_files_are_ignored_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save(tmp_path / "a.png", (1, 2, 3))
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "labels.csv").write_text("a,1")
    (tmp_path / "more.txt").write_text("not an image")
    with caplog.at_level("INFO", logger="sslkit.data"):
        ds = build_source("folder", "train", str(tmp_path))
    assert [Path(p).name for p, _ in ds.samples] == ["a.png"]
    assert any("ignoring 3 other files (.txt: 2, .csv: 1)" in r.getMessage() for r in caplog.records)


# --- synthetic ----------------------------------------------------------------------------------


def test_synthetic_is_deterministic() -> None:
    a = build_source("synthetic", "train", None, num_samples=20, image_size=8, channels=3, num_classes=4)
    b = build_source("synthetic", "train", "/ignored", num_samples=20, image_size=8, channels=3, num_classes=4)
    assert (len(a), a.num_classes, a.channels) == (20, 4, 3)
    for i in (0, 7, 19):
        xa, ya = a[i]
        xb, yb = b[i]
        assert xa.dtype == torch.uint8 and xa.shape == (3, 8, 8)
        assert torch.equal(xa, xb) and ya == yb == i % 4
    assert not torch.equal(a[0][0], a[4][0])  # same class, different noise
    other_seed = build_source("synthetic", "train", None, num_samples=20, image_size=8, seed=1)
    test = build_source("synthetic", "test", None, num_samples=20, image_size=8)
    assert not torch.equal(a[0][0], other_seed[0][0])
    assert not torch.equal(a[0][0], test[0][0])
    with pytest.raises(IndexError):
        a[20]


def test_synthetic_classes_are_separable() -> None:
    ds = build_source("synthetic", "train", None, num_samples=200, image_size=8, num_classes=2)
    x = torch.stack([ds[i][0] for i in range(200)]).float().flatten(1)
    y = torch.tensor([ds[i][1] for i in range(200)])
    centroids = torch.stack([x[y == c].mean(0) for c in (0, 1)])
    accuracy = (torch.cdist(x, centroids).argmin(1) == y).float().mean()
    assert accuracy > 0.9
