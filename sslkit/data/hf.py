"""Hugging Face ``datasets`` on a local disk as a source (``data=hf``): memory-mapped Arrow, every row by its index."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from sslkit.data.channels import AUTO, array_channels, channel_setting, resolve_channels
from sslkit.data.remote import is_url
from sslkit.data.sources import DataSourceError, UnreadableSampleError, array_image, decode_image, encoded_channels
from sslkit.registry import register_dataset

__all__ = ["HFDataset", "build_hf"]

logger = logging.getLogger("sslkit")

#: The split names a saved ``DatasetDict`` may give each of sslkit's splits, in the order they are tried.
SPLIT_NAMES = {"train": ("train",), "test": ("test", "validation", "val")}


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataSourceError("data=hf reads Hugging Face datasets with the `datasets` library, which is not "
                              "installed: pip install 'sslkit[hf]'") from None
    return datasets


def _open(root: Path, split: str) -> tuple[Any, str]:
    """The dataset at ``root`` for sslkit's ``split``: a ``save_to_disk`` folder (a ``Dataset``, or a
    ``DatasetDict`` whose split is picked by name), or Parquet / Arrow files (a file, or a folder of them). Returns
    the dataset and what it is, for the log."""
    datasets = _datasets()
    if root.is_dir() and ((root / "dataset_dict.json").exists() or (root / "state.json").exists()):
        loaded = datasets.load_from_disk(str(root))
        if isinstance(loaded, datasets.DatasetDict):
            name = next((n for n in SPLIT_NAMES[split] if n in loaded), None)
            if name is None:
                raise DataSourceError(f"{root} holds the splits {', '.join(loaded)}, none of them named "
                                      f"{' or '.join(SPLIT_NAMES[split])} (sslkit's {split} split): give that "
                                      f"split's own folder as data.{split}.path")
            return loaded[name], f"split {name} of a saved DatasetDict"
        return loaded, "a saved Dataset"
    files = sorted(root.glob("*.parquet")) + sorted(root.glob("*.arrow")) if root.is_dir() else [root]
    parquet = [str(f) for f in files if f.suffix == ".parquet"]
    arrow = [str(f) for f in files if f.suffix == ".arrow"]
    if parquet:
        return datasets.Dataset.from_parquet(parquet, keep_in_memory=False), f"{len(parquet)} Parquet file(s)"
    if arrow:
        return datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in arrow]), \
            f"{len(arrow)} Arrow file(s)"
    raise DataSourceError(f"{root} is not a Hugging Face dataset: no dataset_dict.json or state.json "
                          "(datasets' save_to_disk), and no .parquet or .arrow files")


class HFDataset(Dataset):
    """Rows of a Hugging Face dataset on local disk, each an image and optionally a label, addressed by row index.

    The dataset is memory-mapped (Arrow), so loader workers share its pages instead of copying it. ``image_column``
    holds images (a ``datasets.Image`` feature, encoded bytes, or file paths; or the pixels themselves, an
    ``Array2D`` / ``Array3D`` feature of any channels, as :func:`~sslkit.data.sources.array_image` reads them), decoded
    lazily (PIL, or ``.npy`` / TIFF
    bytes of any channels and 16 bits: :func:`~sslkit.data.sources.decode_image`) to ``[C, H, W]`` (a JPEG's bytes,
    1-D, with :attr:`jpeg_bytes` for ``data.decode_on=device``); ``label_column`` (None: no labels, -1) holds integer
    class indices (``num_classes`` from a ``ClassLabel`` feature, else the largest + 1).
    A row that cannot be decoded raises :class:`UnreadableSampleError` (skipped and counted by the dataset).
    """

    def __init__(self, root: str | Path, split: str = "train", image_column: str = "image",
                 label_column: str | None = None, channels: int | str = AUTO) -> None:
        channels = channel_setting(channels)
        datasets = _datasets()
        self.root = Path(root).expanduser()
        if not self.root.exists():
            raise DataSourceError(f"{self.root} does not exist: give a folder written by datasets' save_to_disk, or "
                                  "Parquet / Arrow files")
        ds, what = _open(self.root, split)
        columns = list(ds.column_names)
        for key, column in (("image_column", image_column), ("label_column", label_column)):
            if column is not None and column not in columns:
                raise DataSourceError(f"{self.root} has no column '{column}' (data.{split}.kwargs.{key}); its columns: "
                                      f"{', '.join(columns)}")
        if len(ds) == 0:
            raise DataSourceError(f"{self.root} ({what}) has no rows")
        feature = ds.features[image_column]
        if isinstance(feature, datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))  # bytes / path, decoded here
        #: An ``Array2D`` / ``Array3D`` image column (pixels as numbers: any channels, 8 or 16 bits, float in 0..1):
        #: rows read as NumPy arrays. False for encoded images.
        self.arrays = isinstance(feature, datasets.Array2D | datasets.Array3D)
        self.array_dtype = str(feature.dtype) if self.arrays else None  # the feature's (a cell may come as int64)
        self.jpeg_bytes = False
        self.image_column, self.label_column = image_column, label_column
        self.classes: list[str] = []
        if label_column is not None:
            label = ds.features[label_column]
            if isinstance(label, datasets.ClassLabel):
                self.classes = list(label.names)
            elif not str(getattr(label, "dtype", "")).startswith(("int", "uint")):
                raise DataSourceError(f"{self.root}: column '{label_column}' (data.{split}.kwargs.label_column) holds "
                                      f"{getattr(label, 'dtype', label)}, not integer class indices")
        self.ds = ds.select_columns([image_column] + ([label_column] if label_column else []))
        if self.arrays:
            self.ds = self.ds.with_format("numpy")
        self.num_classes = len(self.classes) or (self._largest_label() + 1 if label_column else 0)
        self.channels = resolve_channels(channels, self.native_channels, len(self.ds), str(self.root))
        logger.info("data: %s, %s: %d rows, images in '%s'%s", self.root, what, len(self.ds), image_column,
                    f", labels in '{label_column}' ({self.num_classes} classes)" if label_column else ", no labels")

    @property
    def labels(self) -> Any:
        """Every row's label read from the Arrow column without decoding an image (what
        :func:`~sslkit.data.sources.dataset_labels` reads for ``data.classes`` and the reference sets), or None
        without a label column."""
        if not self.label_column:
            return None
        return self.ds.data.column(self.label_column).to_numpy()

    def _largest_label(self) -> int:
        """The label column's maximum, computed by Arrow on the memory-mapped column (a Python pass over a million
        rows takes seconds)."""
        import pyarrow.compute as pc

        return int(pc.max(self.ds.data.column(self.label_column)).as_py())

    def __len__(self) -> int:
        """The number of rows."""
        return len(self.ds)

    def native_channels(self, i: int) -> int:
        """The channels row ``i``'s image holds: an array cell's (:func:`~sslkit.data.channels.array_channels`) or
        its encoded bytes' (:func:`~sslkit.data.sources.encoded_channels`)."""
        value = self.ds[int(i)][self.image_column]
        if self.arrays:
            return array_channels(np.asarray(value))
        return encoded_channels(self._bytes(value, i), f"the image of row {i} of {self.root}")

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """Row ``i``'s image as uint8 ``[C, H, W]`` (or a JPEG's bytes) and its label (-1 without labels)."""
        row = self.ds[int(i)]
        label = int(row[self.label_column]) if self.label_column else -1
        if self.arrays:
            cell = np.asarray(row[self.image_column], dtype=self.array_dtype)
            return array_image(cell, self.channels, f"row {i} of {self.root}"), label
        data = self._bytes(row[self.image_column], i)
        image = decode_image(data, self.channels, self.jpeg_bytes, f"the image of row {i} of {self.root}",
                             f"{self.root}[{i}]")
        return image, label

    def _bytes(self, value: Any, i: int) -> bytes:
        """The encoded image of a cell: an Image feature's ``{bytes, path}``, raw bytes, or a file path."""
        path = None
        if isinstance(value, dict):
            if value.get("bytes"):
                return bytes(value["bytes"])
            path = value.get("path")
        elif isinstance(value, (bytes, bytearray)):
            return bytes(value)
        elif isinstance(value, str):
            path = value
        if not path:
            raise UnreadableSampleError(f"row {i} of {self.root} has no image in '{self.image_column}'",
                                        f"{self.root}[{i}]")
        file = Path(path) if Path(path).is_absolute() else self.root / path
        try:
            return file.read_bytes()
        except OSError as e:
            raise UnreadableSampleError(f"cannot read {file} (row {i} of {self.root}): {e}", str(file)) from e


@register_dataset("hf")
def build_hf(split: str, path: str | None = None, image_column: str = "image", label_column: str | None = None,
             channels: int | str = AUTO, storage_options: dict[str, Any] | None = None, cache_dir: str | None = None,
             retries: dict[str, Any] | None = None, cache_gb: float = 0.0) -> Dataset:
    """A Hugging Face dataset (``data=hf``): ``path`` a ``save_to_disk`` folder (a ``DatasetDict``'s split picked by
    name) or Parquet / Arrow files on local disk, or Parquet files in object storage (``s3://bucket/ds/``, read by
    :class:`~sslkit.data.hf_remote.RemoteParquet` with ``storage_options``, ``cache_dir``, ``retries`` and
    ``cache_gb``, which the builder passes); images in ``image_column``, labels in ``label_column``."""
    if not path:
        raise DataSourceError(f"the 'hf' source needs a dataset folder or files: set data.{split}.path")
    try:
        if is_url(path):
            from sslkit.data.hf_remote import RemoteParquet
            from sslkit.data.remote import Retries

            return RemoteParquet(path, split, image_column, label_column, channels, storage_options, cache_dir,
                                 Retries(**retries) if retries else None, cache_gb)
        return HFDataset(path, split, image_column, label_column, channels)
    except DataSourceError as e:
        raise DataSourceError(f"data.{split}.path: {e}") from None
