"""Data sources: registered builders returning datasets of ``(uint8 [C,H,W] image, int label)``."""

from __future__ import annotations

import functools
import gzip
import inspect
import io
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset

from sslkit.data.channels import (
    AUTO,
    array_channels,
    channel_setting,
    convert_channels,
    first_readable,
    jpeg_channels,
    pil_channels,
    resolve_channels,
    say_conversion,
)
from sslkit.data.errors import DataSourceError, UnreadableSampleError
from sslkit.data.seeding import mix_seed
from sslkit.errors import plural
from sslkit.registry import DATASETS, get, register_dataset

__all__ = [
    "ARRAY_EXTENSIONS",
    "DEBIAN_FASHION_MNIST",
    "IMAGE_EXTENSIONS",
    "DataSourceError",
    "FileListDataset",
    "FolderDataset",
    "SourceShape",
    "SyntheticDataset",
    "TensorImageDataset",
    "UnreadableSampleError",
    "array_image",
    "build_cifar10",
    "build_cifar100",
    "build_fashion_mnist",
    "build_filelist",
    "build_folder",
    "build_source",
    "build_synthetic",
    "cache_dir",
    "counts_channels",
    "dataset_labels",
    "encoded_channels",
    "holds_images",
    "jpeg_as_bytes",
    "read_array_image",
    "read_idx",
    "source_shape",
]

logger = logging.getLogger("sslkit.data")

DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
"""Where the Debian package ``dataset-fashion-mnist`` installs the idx files."""

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".npy")
"""File extensions (lower case) the ``folder`` source reads; matched case-insensitively."""

ARRAY_EXTENSIONS = (".npy", ".tif", ".tiff")
"""Files read as arrays of any channel count and 8 or 16 bits (:func:`read_array_image`): NumPy's ``.npy``, and TIFF
through ``tifffile`` (``pip install 'sslkit[tiff]'``; without it, TIFFs of 1 or 3 channels are read by PIL)."""

#: The first bytes of a NumPy ``.npy`` file and of a TIFF file (little- and big-endian).
NPY_MAGIC = b"\x93NUMPY"
TIFF_MAGICS = (b"II*\x00", b"MM\x00*")

SPLITS = ("train", "test")


def dataset_labels(ds: Any) -> torch.Tensor:
    """The label of every sample of ``ds`` ``[N]`` (int64), read without decoding where the source lists them
    (``labels``, ``targets``, ``samples``; through any ``Subset``), else sample by sample (an unreadable one: -1)."""
    if isinstance(ds, Subset):
        return dataset_labels(ds.dataset)[torch.as_tensor(list(ds.indices), dtype=torch.long)]
    for name in ("labels", "targets"):
        found = getattr(ds, name, None)
        if found is not None and len(found) == len(ds):
            return torch.as_tensor(found, dtype=torch.long)
    samples = getattr(ds, "samples", None)
    if samples is not None and len(samples) == len(ds):
        return torch.tensor([int(y) for _, y in samples], dtype=torch.long)
    labels = []
    for i in range(len(ds)):
        try:
            labels.append(int(ds[i][1]))
        except UnreadableSampleError:
            labels.append(-1)
    return torch.tensor(labels, dtype=torch.long)


def cache_dir() -> Path:
    """Folder for downloaded data: ``$SSLKIT_CACHE_DIR`` if set, else ``~/.cache/sslkit``."""
    return Path(os.environ.get("SSLKIT_CACHE_DIR") or Path("~/.cache/sslkit").expanduser())


def save_arrays(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` to the ``.npz`` file ``path`` whole or not at all: into a file beside it named by this
    process, then renamed over it (a reader, or a process writing the same file, finds all of one or none); the
    folder is made when missing. Raises :class:`OSError` (a read-only folder, a full disk), the partial file
    removed."""
    partial = Path(f"{path}.{os.getpid()}.part.npz")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(partial, **arrays)
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)
        raise


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


class TensorImageDataset(Dataset):
    """An in-memory dataset: all images in one uint8 tensor ``[N, C, H, W]`` plus int64 labels."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, num_classes: int) -> None:
        """Wrap ``images`` (uint8 ``[N,C,H,W]``) and ``labels`` (``[N]``) of ``num_classes`` classes."""
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"images must be uint8 [N,C,H,W], got {images.dtype} {tuple(images.shape)}")
        if labels.ndim != 1 or len(labels) != len(images):
            raise ValueError(f"labels must be [N] with N={len(images)}, got {tuple(labels.shape)}")
        self.images = images
        self.labels = labels.to(torch.int64)
        self.num_classes = int(num_classes)
        self.channels = int(images.shape[1])

    def __len__(self) -> int:
        """Number of images."""
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """Image ``i`` (a copy, so in-place transforms cannot alter the dataset) and its label."""
        return self.images[i].clone(), int(self.labels[i])


def tensor_dataset(images: torch.Tensor, labels: torch.Tensor, num_classes: int, channels: int,
                   key: str) -> TensorImageDataset:
    """A :class:`TensorImageDataset` of ``images`` brought to ``channels`` (1 or 3) by :func:`convert_channels`,
    once, as the sources' data is read; ``key`` is the option that sets ``channels``, named when it is neither."""
    if channels not in (1, 3) or isinstance(channels, bool):
        raise DataSourceError(f"{key} = {channels!r}: these images can be read with 1 (grey) or 3 (RGB) channels")
    converted = convert_channels(images.numpy(), int(channels), key, axis=1)
    return TensorImageDataset(torch.from_numpy(np.ascontiguousarray(converted)), labels, num_classes)


# ----------------------------------------------------------------------------------------------------
# Fashion-MNIST (idx files)
# ----------------------------------------------------------------------------------------------------

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an idx file (plain or ``.gz``) into a numpy array of the shape its header gives.

    The header is big-endian: two zero bytes, a type code (0x08 = uint8), the number of
    dimensions, then one 32-bit size per dimension.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an idx file (bad magic number {data[:4].hex()})")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: idx header truncated")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(f"{path}: idx body has {len(data) - header} bytes, header {dims} says {expected}")
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)


def _find_idx(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _load_idx_pair(folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Load images ``[N,1,H,W]`` and labels ``[N]`` of ``split`` from ``folder``; raise if absent/bad."""
    prefix = "train" if split == "train" else "t10k"
    img_path = _find_idx(folder, f"{prefix}-images-idx3-ubyte")
    lbl_path = _find_idx(folder, f"{prefix}-labels-idx1-ubyte")
    if img_path is None or lbl_path is None:
        raise FileNotFoundError(f"no {prefix}-images-idx3-ubyte[.gz] / {prefix}-labels-idx1-ubyte[.gz]")
    images, labels = read_idx(img_path), read_idx(lbl_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise ValueError(f"{img_path}: expected uint8 [N,H,W], got {images.dtype} {images.shape}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise ValueError(f"{lbl_path}: expected {len(images)} labels, got shape {labels.shape}")
    return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


def _on_canvas(images: torch.Tensor, canvas: int, split: str) -> torch.Tensor:
    """``images`` ``[N, C, h, w]`` centred on black squares of side ``canvas`` (the images when it is theirs)."""
    h, w = images.shape[-2:]
    if isinstance(canvas, bool) or not isinstance(canvas, int) or canvas < max(h, w):
        raise DataSourceError(f"data.{split}.kwargs.canvas = {canvas!r}: the side of the square the {h}x{w} images "
                              f"are centred on, a whole number >= {max(h, w)}")
    top, left = (canvas - h) // 2, (canvas - w) // 2
    return images if (h, w) == (canvas, canvas) else F.pad(images, (left, canvas - w - left, top, canvas - h - top))


def _torchvision_fashion_mnist(root: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Load (downloading if needed) Fashion-MNIST with torchvision; images ``[N,1,28,28]``."""
    from torchvision.datasets import FashionMNIST

    ds = FashionMNIST(root=root, train=train, download=True)
    return ds.data.to(torch.uint8).unsqueeze(1).contiguous(), torch.as_tensor(ds.targets, dtype=torch.int64)


@register_dataset("fashion_mnist")
def build_fashion_mnist(split: str, path: str | None = None, download: bool = True, channels: int = 1,
                        canvas: int = 28) -> TensorImageDataset:
    """Fashion-MNIST (10 classes, 28x28 grey): ``channels=3`` repeats the grey for an RGB trunk, ``canvas`` > 28
    centres each garment on a black square of that side (the proving ground's "studio" domain, ``data=studio``:
    3 channels, 32 px, the wild set's size and its largest garments' scale).

    With ``path`` set, only there: the idx files in ``path`` (or ``path/FashionMNIST/raw``), else
    a torchvision download into ``path`` unless ``download`` is False; a ``path`` that does not
    exist is an error (a typo must not silently read another copy). Without ``path``: the Debian
    package folder :data:`DEBIAN_FASHION_MNIST`, then a download into ``cache_dir()/fashion_mnist``.
    Raises :class:`DataSourceError` naming every place tried if all fail.
    """
    _check_split(split)
    tried: list[str] = []
    candidates: list[tuple[str, Path]] = []
    if path:
        folder = Path(path).expanduser()
        if not folder.is_dir():
            what = "is a file, not a folder" if folder.exists() else "does not exist"
            raise DataSourceError(f"data.{split}.path = {path} {what}: give the folder that holds the Fashion-MNIST "
                                  "idx files (or an empty folder to download into), or leave data.train.path unset "
                                  f"to use the system copy ({DEBIAN_FASHION_MNIST}).")
        candidates.append(("data path", folder))
        if (folder / "FashionMNIST" / "raw").is_dir():  # a torchvision root
            candidates.append(("data path", folder / "FashionMNIST" / "raw"))
    else:
        tried.append("data path: not set")
        candidates.append(("Debian package folder", Path(DEBIAN_FASHION_MNIST)))
    for what, folder in candidates:
        if not folder.is_dir():
            tried.append(f"{what} {folder}: does not exist")
            continue
        try:
            images, labels = _load_idx_pair(folder, split)
        except (OSError, ValueError, EOFError) as e:
            tried.append(f"{what} {folder}: {e}")
            continue
        logger.debug("fashion_mnist %s: %d images from %s", split, len(images), folder)
        return tensor_dataset(_on_canvas(images, canvas, split), labels, 10, channels,
                                  f"data.{split}.kwargs.channels")

    root = str(path) if path else str(cache_dir() / "fashion_mnist")
    if download:
        try:
            images, labels = _torchvision_fashion_mnist(root, train=split == "train")
            return tensor_dataset(_on_canvas(images, canvas, split), labels, 10, channels,
                                  f"data.{split}.kwargs.channels")
        except Exception as e:
            tried.append(f"torchvision download into {root}: {type(e).__name__}: {e}")
    else:
        tried.append(f"torchvision download into {root}: skipped (download=False)")
    raise DataSourceError(
        f"cannot find Fashion-MNIST ({split} split). Tried:\n  - "
        + "\n  - ".join(tried)
        + "\nTo get the data: `apt-get install dataset-fashion-mnist` (installs into "
        f"{DEBIAN_FASHION_MNIST}), or download the four idx files and set data.{split}.path to their folder."
    )


# ----------------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (torchvision)
# ----------------------------------------------------------------------------------------------------


def _torchvision_cifar(name: str, root: str, train: bool, download: bool) -> tuple[np.ndarray, list[int]]:
    """Load CIFAR with torchvision; returns the stored ``[N,H,W,C]`` uint8 array and the labels."""
    from torchvision import datasets

    cls = {"cifar10": datasets.CIFAR10, "cifar100": datasets.CIFAR100}[name]
    ds = cls(root=root, train=train, download=download)
    return ds.data, list(ds.targets)


def _build_cifar(name: str, num_classes: int, split: str, path: str | None, download: bool,
                 channels: int) -> TensorImageDataset:
    _check_split(split)
    root = str(path) if path else str(cache_dir() / name)
    errors: list[str] = []
    for dl in (False, True) if download else (False,):
        try:
            data, targets = _torchvision_cifar(name, root, train=split == "train", download=dl)
        except Exception as e:
            errors.append(f"{'with' if dl else 'without'} download: {type(e).__name__}: {e}")
            continue
        images = torch.from_numpy(np.ascontiguousarray(data)).permute(0, 3, 1, 2).contiguous()
        return tensor_dataset(images, torch.as_tensor(targets, dtype=torch.int64), num_classes, channels,
                              f"data.{split}.kwargs.channels")
    raise DataSourceError(
        f"cannot load {name} ({split} split) from {root}: "
        + "; ".join(errors)
        + f". Put the torchvision copy of {name} there (or allow download), or set data.{split}.path."
    )


@register_dataset("cifar10")
def build_cifar10(split: str, path: str | None = None, download: bool = True,
                  channels: int = 3) -> TensorImageDataset:
    """CIFAR-10 via torchvision from ``path`` (default ``cache_dir()/cifar10``), downloading if allowed; RGB, or
    ``channels=1`` for their luma."""
    return _build_cifar("cifar10", 10, split, path, download, channels)


@register_dataset("cifar100")
def build_cifar100(split: str, path: str | None = None, download: bool = True,
                  channels: int = 3) -> TensorImageDataset:
    """CIFAR-100 via torchvision from ``path`` (default ``cache_dir()/cifar100``), downloading if allowed; RGB, or
    ``channels=1`` for their luma."""
    return _build_cifar("cifar100", 100, split, path, download, channels)


# ----------------------------------------------------------------------------------------------------
# Image folders
# ----------------------------------------------------------------------------------------------------


#: The first bytes of every JPEG file (SOI marker and the next marker's 0xFF).
JPEG_MAGIC = b"\xff\xd8\xff"


def is_jpeg(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a JPEG (by its bytes, not its name)."""
    return head[:3] == JPEG_MAGIC


def jpeg_as_bytes(data: bytes, channels: int, name: str) -> torch.Tensor:
    """A JPEG's bytes as they are (1-D uint8, for the device decoder), its component count said first where it is not
    the run's (:func:`~sslkit.data.channels.say_conversion`: the device decoder reads it as grey or RGB)."""
    found = jpeg_channels(data)
    if found is not None:
        say_conversion(name, found, channels)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_image(data: bytes, channels: int, jpeg_bytes: bool, where: str, name: str) -> torch.Tensor:
    """Encoded image ``data`` as ``[C, H, W]`` (PIL for 1 or 3 channels, 16-bit grey kept; ``.npy`` and TIFF bytes of
    any channels through :func:`read_array_image`), or, with ``jpeg_bytes`` and a JPEG, its
    bytes as they are (1-D, for the device decoder). An image PIL cannot decode raises :class:`UnreadableSampleError`
    saying ``where`` it was (``name``: the file or sample the skip count names)."""
    if jpeg_bytes and is_jpeg(data[:3]):
        return jpeg_as_bytes(data, channels, name)
    if data[:6] == NPY_MAGIC or (data[:4] in TIFF_MAGICS and _tiff_as_array(channels)):
        return read_array_image(where, channels, data)
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            arr = _pil_pixels(img, channels, name)
    except Exception as e:  # PIL raises many types
        raise UnreadableSampleError(f"cannot decode {where}: {type(e).__name__}: {e}", name) from e
    t = torch.from_numpy(arr.copy())
    return t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1).contiguous()


def encoded_channels(data: bytes, where: str, name: str | None = None) -> int:
    """The channels of encoded image ``data`` as :func:`decode_image` would find them in the file: a ``.npy`` or
    (with ``tifffile``) a TIFF array's by :func:`~sslkit.data.channels.array_channels`, a TIFF's bands through PIL
    with any alpha band counted, another image's bands without its alpha. Raises :class:`UnreadableSampleError`
    saying ``where`` for data that does not decode (``name``: the file the skip count names; ``where`` by
    default)."""
    tiff = data[:4] in TIFF_MAGICS
    try:
        if data[:6] == NPY_MAGIC or (tiff and _has_tifffile()):
            return array_channels(_load_array(io.BytesIO(data), npy=data[:6] == NPY_MAGIC))
        from PIL import Image

        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return pil_channels(img, alpha=tiff)
    except Exception as e:  # PIL, NumPy and tifffile raise many types
        raise UnreadableSampleError(f"cannot read {where}: {type(e).__name__}: {e}", name or where) from e


def _load_array(source: Any, npy: bool) -> np.ndarray:
    """A ``.npy`` (NumPy, no pickles) or TIFF (``tifffile``) file's array."""
    if npy:
        return np.load(source, allow_pickle=False)
    import tifffile

    return tifffile.imread(source)


def _channels_first(arr: np.ndarray, channels: int, where: str) -> np.ndarray:
    """A decoded array ``[H, W]``, ``[H, W, C]`` or ``[C, H, W]`` as ``[channels, H, W]``: the axis of ``channels``
    entries is the channel axis (the last when both ends have it); as PIL's conversions, a 2-D image for 3 channels is
    repeated, a 3- or 4-channel (RGBA) one for one channel becomes its luma, an RGBA one for 3 channels loses alpha."""
    if arr.ndim == 2:
        arr = arr[None]
    elif arr.ndim != 3:
        raise UnreadableSampleError(f"{where}: an array of shape {arr.shape}; an image is [H, W], [H, W, C] or "
                                    "[C, H, W]", where)
    elif arr.shape[-1] == channels or (arr.shape[0] != channels and arr.shape[-1] <= 4 < arr.shape[0]):
        arr = np.moveaxis(arr, -1, 0)
    say_conversion(where, int(arr.shape[0]), channels)
    return convert_channels(arr, channels, where)


def read_array_image(path: str | Path, channels: int, data: bytes | None = None) -> torch.Tensor:
    """A ``.npy`` or TIFF image as ``[channels, H, W]``: uint8, uint16 (16-bit files keep their depth: the transforms
    divide by 65535), or float32 (taken to be in 0..1), by :func:`_channels_first`'s rule; read from ``path``, or
    from ``data`` (the file's bytes, e.g. a tar shard's member; ``path`` then names it). Other pixel types (signed,
    64-bit) and a missing ``tifffile`` raise with what to do; a file that cannot be read raises
    :class:`UnreadableSampleError`."""
    where = str(path)
    npy = data[:6] == NPY_MAGIC if data is not None else where.lower().endswith(".npy")
    try:
        source: Any = io.BytesIO(data) if data is not None else where
        if not npy and not _has_tifffile():
            raise DataSourceError(f"{where}: TIFF images of {channels} channels or 16 bits are read with tifffile: "
                                  "pip install 'sslkit[tiff]'")
        arr = _load_array(source, npy)
    except DataSourceError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise UnreadableSampleError(f"cannot read image {where}: {type(e).__name__}: {e}", where) from e
    return array_image(arr, channels, where)


def array_image(arr: np.ndarray, channels: int, where: str) -> torch.Tensor:
    """An image held as an array (a ``.npy`` or TIFF file's, a Hugging Face ``Array3D`` cell's) as ``[channels, H,
    W]``: uint8, uint16 (16-bit depth kept) or float (float32, taken to be in 0..1), its channel axis found by
    :func:`_channels_first`'s rule. Other pixel types raise :class:`UnreadableSampleError` naming ``where``."""
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    if arr.dtype not in (np.uint8, np.uint16, np.float32):
        raise UnreadableSampleError(f"{where}: pixels of type {arr.dtype}; sslkit reads 8- and 16-bit unsigned "
                                    "images (uint8, uint16) and float ones in 0..1: convert the data", where)
    return torch.from_numpy(np.ascontiguousarray(_channels_first(arr, channels, where)))


def _pil_pixels(img: Any, channels: int, where: str = "an image") -> np.ndarray:
    """A PIL image as ``[H, W]`` / ``[H, W, 3]`` of ``channels``: 8-bit through ``convert``; a 16-bit grey one
    (PNG's ``I;16``) keeps its 16 bits as uint16 (``convert("L")`` would clip it at 255). Another band count than
    ``channels`` is said (:func:`say_conversion`, naming ``where``)."""
    say_conversion(where, 3 if img.mode == "P" else len(img.getbands()), channels)  # (a palette's entries: RGB)
    if img.mode.startswith("I;16") or (img.mode == "I" and channels == 1):
        arr = np.asarray(img)
        if arr.dtype != np.uint16:
            arr = np.clip(arr, 0, 65535).astype(np.uint16)
        return arr if channels == 1 else np.repeat(arr[..., None], 3, axis=-1)
    return np.asarray(img.convert("L" if channels == 1 else "RGB"), dtype=np.uint8)


def _has_image_ext(name: str) -> bool:
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _scan(folder: Path, recursive: bool) -> tuple[list[str], list[str]]:
    """Image files and other (non-hidden) files in ``folder`` (and below it if ``recursive``), sorted.

    Hidden files and folders (names starting with ``.``) are neither listed nor counted.
    """
    images: list[str] = []
    others: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")] if recursive else []
        for f in filenames:
            if _has_image_ext(f):
                images.append(os.path.join(dirpath, f))
            elif not f.startswith("."):
                others.append(os.path.join(dirpath, f))
    return sorted(images), sorted(others)


def holds_images(root: str | Path, limit: int = 2_000) -> bool | None:
    """Whether ``root`` or a (non-hidden) folder below it holds a file with an image extension, what
    :class:`FolderDataset` needs: True at the first image found, False when the tree has none, None when ``limit``
    entries were looked at without an answer (a large tree: :class:`FolderDataset` decides when it lists it)."""
    seen = 0
    for _dirpath, dirnames, filenames in os.walk(Path(root).expanduser()):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        if any(_has_image_ext(f) for f in filenames):
            return True
        seen += len(filenames) + len(dirnames)
        if seen > limit:
            return None
    return False


def _describe_others(others: list[str]) -> str:
    """``"3 other files (.txt: 2, .gif: 1)"`` for files without an image extension."""
    counts: dict[str, int] = {}
    for f in others:
        ext = os.path.splitext(f)[1].lower() or "no extension"
        counts[ext] = counts.get(ext, 0) + 1
    kinds = ", ".join(f"{ext}: {n}" for ext, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{plural(len(others), 'other file')} ({kinds})"


def _reads_as_array(path: str, channels: int) -> bool:
    """``.npy`` files always; TIFF files as :func:`_tiff_as_array` says."""
    ext = os.path.splitext(path)[1].lower()
    return ext == ".npy" or (ext in ARRAY_EXTENSIONS and _tiff_as_array(channels))


def _tiff_as_array(channels: int) -> bool:
    """TIFFs are read by ``tifffile`` when it is installed or the channels are not PIL's 1 or 3 (then without it
    the read says to install it); else by PIL."""
    return channels not in (1, 3) or _has_tifffile()


@functools.cache
def _has_tifffile() -> bool:
    """Whether ``tifffile`` can be imported: looked up once per process, not for every image read."""
    import importlib.util

    return importlib.util.find_spec("tifffile") is not None


class FolderDataset(Dataset):
    """Images in a folder, decoded lazily with PIL.

    Either an ImageFolder tree (one subfolder per class, images anywhere below it; labels are the
    sorted class names' positions) or a flat folder of images (label -1, ``num_classes`` 0).
    Files are images by their extension (:data:`IMAGE_EXTENSIONS`); other files are ignored and
    counted in one log line. A corrupt or truncated image raises :class:`UnreadableSampleError`
    when it is read (:class:`~sslkit.data.SSLDataset` skips it and counts it).
    """

    def __init__(self, root: str | Path, channels: int | str = AUTO, probe: int = 32) -> None:
        """Index the image files under ``root``; ``channels`` is how many each image is read with (3: RGB, 1: grey,
        any count for arrays), or ``auto``: the count of the first readable file (:func:`encoded_channels`).

        Raises :class:`DataSourceError` if ``root`` is missing, not a folder or holds no image
        files, and, unless ``probe`` is 0, if none of up to ``probe`` files spread evenly over the
        dataset (all of them if there are fewer) can be decoded. The probe stops at the first
        readable file, so on a healthy folder it costs one decode.
        """
        channels = channel_setting(channels)
        #: Give JPEG files as their bytes (1-D uint8), for a decoder on the training device
        #: (``data.decode_on=device``); other files are still decoded here.
        self.jpeg_bytes = False
        root = Path(root).expanduser()
        if not root.exists():
            raise DataSourceError(f"image folder {root} does not exist")
        if not root.is_dir():
            raise DataSourceError(f"image folder {root} is a file, not a folder: give the folder holding the images")
        self.root = root
        class_files: dict[str, list[str]] = {}
        others: list[str] = []
        for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            images, other = _scan(d, recursive=True)
            others += other
            if images:
                class_files[d.name] = images
        loose, loose_others = _scan(root, recursive=False)
        others += loose_others
        if class_files:
            self.classes = list(class_files)
            self.samples = [(f, c) for c, name in enumerate(self.classes) for f in class_files[name]]
            if loose:
                logger.warning("%s is a class-folder tree; ignoring %d image(s) directly in it", root, len(loose))
        else:
            self.classes = []
            self.samples = [(f, -1) for f in loose]
        if not self.samples:
            found = f"found only {_describe_others(others)}" if others else "the folder is empty"
            raise DataSourceError(
                f"no image files in {root} ({found}); looked for extensions {', '.join(IMAGE_EXTENSIONS)}, "
                "any case, in the folder and in its class subfolders"
            )
        if others:
            logger.info("%s: ignoring %s without an image extension", root, _describe_others(others))
        self.num_classes = len(self.classes)
        self.channels = resolve_channels(channels, self.native_channels, len(self.samples), str(root))
        if probe > 0:
            self._probe(probe)

    def native_channels(self, i: int) -> int:
        """The channels file ``i`` holds (:func:`encoded_channels`), whatever the dataset reads it with."""
        path = self.samples[i][0]
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise UnreadableSampleError(f"cannot read image {path}: {type(e).__name__}: {e}", path) from e
        return encoded_channels(data, f"image {path}", path)

    def _probe(self, limit: int) -> None:
        """Decode files spread over the dataset until one works; raise if the first ``limit`` all fail."""
        first_readable(lambda i: self[i], len(self.samples), str(self.root), limit)

    def __len__(self) -> int:
        """Number of image files."""
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """Decode image ``i`` to uint8 ``[C,H,W]`` (a JPEG's bytes, 1-D, with :attr:`jpeg_bytes`); raise
        :class:`UnreadableSampleError` if it is bad."""
        from PIL import Image

        path, label = self.samples[i]
        if self.jpeg_bytes:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise UnreadableSampleError(f"cannot read image {path}: {type(e).__name__}: {e}", path) from e
            if is_jpeg(data):
                return jpeg_as_bytes(data, self.channels, path), label
        if _reads_as_array(path, self.channels):
            return read_array_image(path, self.channels), label
        try:
            with Image.open(path) as img:
                img.load()
                arr = _pil_pixels(img, self.channels, path)
        except Exception as e:  # PIL raises many types (OSError, SyntaxError, ValueError, ...)
            raise UnreadableSampleError(f"cannot read image {path}: {type(e).__name__}: {e}", path) from e
        t = torch.from_numpy(arr.copy())
        t = t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1).contiguous()
        return t, label


class FileListDataset(FolderDataset):
    """Images named in a list file, decoded lazily like :class:`FolderDataset` (its probe, errors and device decode).

    One image per line: ``path`` or ``path,label`` (CSV, an optional header ``path,label``), or ``path label``
    (whitespace). Blank lines and lines starting with ``#`` are skipped. Relative paths are relative to the list
    file's folder. Labels are all integers (used as they are; ``num_classes`` = largest + 1), all names (indexed
    in sorted order, ``classes``), or absent on every line (label -1, ``num_classes`` 0: pretraining data).
    """

    def __init__(self, list_file: str | Path, channels: int | str = AUTO, probe: int = 32) -> None:
        """Read ``list_file`` (``channels`` as :class:`FolderDataset`'s); raise :class:`DataSourceError` for a missing
        list, an empty one, listed files that do not exist (counted, the first named with their line), or lines that
        mix labelled and unlabelled."""
        channels = channel_setting(channels)
        self.jpeg_bytes = False
        path = Path(list_file).expanduser()
        if not path.exists():
            raise DataSourceError(f"file list {path} does not exist: give the CSV or text file that lists the "
                                  "images, one 'path' or 'path,label' a line")
        if path.is_dir():
            raise DataSourceError(f"{path} is a folder: the filelist source takes a file listing the images (the "
                                  "folder source takes a folder)")
        self.root = path
        entries = _read_list(path)
        if not entries:
            raise DataSourceError(f"file list {path} names no image (lines are 'path' or 'path,label')")
        missing = [(n, f) for n, f, _ in entries if not os.path.isfile(f)]
        if missing:
            shown = "".join(f"\n  {path}:{n}: {f}" for n, f in missing[:5])
            header = ""
            if missing[0][0] == entries[0][0] and not _has_image_ext(os.path.basename(missing[0][1])):
                header = " If line 1 is a header, it must read 'path' or 'path,label'."
            raise DataSourceError(f"{len(missing)} of the {len(entries)} files listed in {path} do not exist, e.g.:"
                                  f"{shown}\nRelative paths are read from the list's folder ({path.parent}): fix "
                                  f"the paths or copy the files there.{header}")
        labelled = [e for e in entries if e[2] is not None]
        if labelled and len(labelled) != len(entries):
            line = next(n for n, _, label in entries if label is None)
            raise DataSourceError(f"{path}:{line}: no label, but other lines have one: give every line a label, or "
                                  "none (unlabelled pretraining data)")
        if not labelled:
            self.classes: list[str] = []
            self.samples = [(f, -1) for _, f, _ in entries]
            self.num_classes = 0
        elif all(label.lstrip("-").isdigit() for _, _, label in labelled):  # type: ignore[union-attr]
            ints = [int(label) for _, _, label in labelled]  # type: ignore[arg-type]
            if min(ints) < 0:
                n = next(n for n, _, label in labelled if int(label) < 0)  # type: ignore[arg-type]
                raise DataSourceError(f"{path}:{n}: negative label; labels are 0, 1, ... or class names")
            self.classes = [str(i) for i in range(max(ints) + 1)]
            self.samples = [(f, int(label)) for _, f, label in labelled]  # type: ignore[arg-type]
            self.num_classes = max(ints) + 1
        else:
            self.classes = sorted({str(label) for _, _, label in labelled})
            index = {name: i for i, name in enumerate(self.classes)}
            self.samples = [(f, index[str(label)]) for _, f, label in labelled]
            self.num_classes = len(self.classes)
        self.channels = resolve_channels(channels, self.native_channels, len(self.samples), str(path))
        if probe > 0:
            self._probe(probe)


#: First lines of a file list that are a CSV header, not an image.
_HEADERS = (["path"], ["path", "label"], ["file", "label"], ["filename", "label"], ["image", "label"])


def _read_list(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line number, absolute file, label or None)`` of each entry of a file list (see :class:`FileListDataset`)."""
    entries: list[tuple[int, str, str | None]] = []
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a spreadsheet's CSV may start with a byte-order mark
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        what = ("it is an image: give a file listing the images (or data=folder for a folder of them)"
                if _has_image_ext(path.name) else "save the list as UTF-8 text, one 'path' or 'path,label' a line")
        raise DataSourceError(f"{path}:{line}: not UTF-8 text ({e.reason}); {what}") from None
    except OSError as e:
        raise DataSourceError(f"cannot read file list {path}: {e.strerror or e}") from None
    for n, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",")] if "," in line else line.split()
        if not entries and [p.lower() for p in parts] in _HEADERS:
            continue  # a CSV header
        if len(parts) > 2:
            raise DataSourceError(f"{path}:{n}: {len(parts)} fields; a line is 'path' or 'path,label' (a path with a "
                                  "comma or spaces: quote-free CSV cannot hold it, rename the file)")
        file = parts[0] if os.path.isabs(parts[0]) else os.path.normpath(os.path.join(path.parent, parts[0]))
        entries.append((n, file, parts[1] if len(parts) == 2 and parts[1] != "" else None))
    return entries


def _path_source(cls: Any, source: str, needs: str, split: str, path: str | None, channels: int | str) -> Any:
    """Build a dataset read from ``data.<split>.path``; a missing or bad path names the key to set."""
    _check_split(split)
    if not path:
        raise DataSourceError(f"the '{source}' source needs {needs}: set data.{split}.path")
    try:
        return cls(path, channels=channels)
    except DataSourceError as e:
        raise DataSourceError(f"data.{split}.path: {e}") from None


@register_dataset("filelist")
def build_filelist(split: str, path: str | None = None, channels: int | str = AUTO) -> FileListDataset:
    """Images named in a list file (CSV or text: ``path[,label]``); the caller passes the split's own list."""
    return _path_source(FileListDataset, "filelist", "a list file", split, path, channels)


@register_dataset("folder")
def build_folder(split: str, path: str | None = None, channels: int | str = AUTO) -> FolderDataset:
    """Images under ``path`` (ImageFolder tree or flat folder); the caller passes the split's own path."""
    return _path_source(FolderDataset, "folder", "a path", split, path, channels)


# ----------------------------------------------------------------------------------------------------
# Synthetic
# ----------------------------------------------------------------------------------------------------


class SyntheticDataset(Dataset):
    """Deterministic random images, generated per index; label ``index % num_classes``.

    Each image is half per-index noise and half a smooth per-class pattern, so labels are
    learnable (useful for smoke tests of training and evaluation). The class patterns depend on
    ``seed`` only; the noise also on ``stream`` (the train and test splits use different streams).
    """

    def __init__(
        self,
        num_samples: int = 512,
        image_size: int = 32,
        channels: int = 3,
        num_classes: int = 10,
        seed: int = 0,
        stream: int = 0,
    ) -> None:
        """Describe ``num_samples`` images of ``channels`` x ``image_size`` x ``image_size``."""
        if num_samples < 0 or num_classes < 0 or image_size < 1 or channels < 1:
            raise ValueError("num_samples and num_classes must be >= 0, image_size and channels >= 1")
        self.num_samples = int(num_samples)
        self.image_size = int(image_size)
        self.channels = int(channels)
        self.num_classes = int(num_classes)
        self.seed = int(seed)
        self.stream = int(stream)
        g = torch.Generator().manual_seed(mix_seed(self.seed, 0xC1A55))
        protos = torch.rand(max(num_classes, 1), channels, 4, 4, generator=g)
        self._protos = (
            torch.nn.functional.interpolate(protos, size=(image_size, image_size), mode="bilinear", align_corners=False)
            .mul_(127.0)
            .to(torch.uint8)
        )

    def __len__(self) -> int:
        """``num_samples``."""
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """Image ``i`` (same bytes for the same ``seed``, ``stream`` and ``i``) and its label."""
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"index {i} out of range for {self.num_samples} samples")
        i %= self.num_samples
        g = torch.Generator().manual_seed(mix_seed(self.seed, self.stream, i))
        s = self.image_size
        noise = torch.randint(0, 128, (self.channels, s, s), generator=g, dtype=torch.uint8)
        label = i % self.num_classes if self.num_classes else -1
        return noise + self._protos[max(label, 0)], label


@register_dataset("synthetic")
def build_synthetic(
    split: str,
    path: str | None = None,
    num_samples: int = 512,
    image_size: int = 32,
    channels: int = 3,
    num_classes: int = 10,
    seed: int = 0,
) -> SyntheticDataset:
    """Synthetic images (``path`` ignored); both splits share class patterns but not noise."""
    _check_split(split)
    return SyntheticDataset(num_samples, image_size, channels, num_classes, seed, stream=SPLITS.index(split))


class SourceShape(NamedTuple):
    """What is known about a source's images before it is built; None where it depends on the files."""

    channels: int | None
    image_size: int | None  # the side of its square images
    num_samples: int | None


_FIXED_SHAPES = {"fashion_mnist": (1, 28), "cifar10": (3, 32), "cifar100": (3, 32)}
#: The images of the fixed datasets' splits (Fashion-MNIST: 60,000 / 10,000; CIFAR: 50,000 / 10,000).
_FIXED_SIZES = {"train": {"fashion_mnist": 60000, "cifar10": 50000, "cifar100": 50000},
                "test": {"fashion_mnist": 10000, "cifar10": 10000, "cifar100": 10000}}


def source_shape(name: str, kwargs: Mapping[str, Any] | None = None, split: str | None = None) -> SourceShape:
    """Channels, image side and length of the registered source ``name`` built with ``kwargs``, as far as they are
    known without reading data (for config checks): Fashion-MNIST is 1x28x28 (60,000 training images; its
    ``channels`` and ``canvas`` where given), CIFAR 3x32x32 (50,000; its ``channels``), ``synthetic`` follows its
    arguments, ``folder`` and ``filelist`` their ``channels`` (unknown for ``auto``; sizes vary); other sources:
    unknown. A fixed dataset's length is given for a named ``split`` only.
    """
    kwargs = dict(kwargs or {})
    if name in _FIXED_SHAPES:
        channels, size = _FIXED_SHAPES[name]
        return SourceShape(int(kwargs.get("channels", channels)), int(kwargs.get("canvas", size)),
                           _FIXED_SIZES.get(split or "", {}).get(name))
    if name in ("synthetic", "folder", "filelist"):
        params = inspect.signature(build_synthetic if name == "synthetic" else build_folder).parameters
        value = {k: kwargs.get(k, p.default) for k, p in params.items()}
        if name in ("folder", "filelist"):
            return SourceShape(None if value["channels"] == AUTO else int(value["channels"]), None, None)
        return SourceShape(int(value["channels"]), int(value["image_size"]), int(value["num_samples"]))
    return SourceShape(None, None, None)


def counts_channels(name: str, kwargs: Mapping[str, Any] | None = None) -> bool:
    """Whether the registered source ``name`` built with ``kwargs`` counts its channels from the data
    (``channels: auto``, given or its builder's default)."""
    builder = get(DATASETS, name, where="data.<split>.source")
    param = inspect.signature(builder).parameters.get("channels")
    return param is not None and (kwargs or {}).get("channels", param.default) == AUTO


def build_source(name: str, split: str, path: str | None = None, **kwargs: Any) -> Dataset:
    """Build the registered data source ``name`` for ``split`` ("train" or "test")."""
    builder: Callable[..., Dataset] = get(DATASETS, name, where=f"data.{split}.source")
    return builder(split=split, path=path, **kwargs)
