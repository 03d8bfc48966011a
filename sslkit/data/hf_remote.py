"""Hugging Face datasets as Parquet files in object storage (``data=hf data.train.path=s3://bucket/ds/``), addressed by
row: each file's row groups and labels read once and cached locally by its ETag, a row read from its row group
(a ranged read of the image column's chunk, the last few groups kept), or from the whole file on local disk once
``data.cache_gb`` lets it be fetched."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from sslkit.data.channels import AUTO, channel_setting, resolve_channels
from sslkit.data.remote import (
    Remote,
    RemoteReadError,
    Retries,
    cache_key,
    cache_root,
    expand_braces,
    refuse_http_listing,
    url_protocol,
)
from sslkit.data.shard_cache import ShardCache
from sslkit.data.sources import DataSourceError, UnreadableSampleError, decode_image, encoded_channels

__all__ = ["RemoteParquet", "parquet_files"]

logger = logging.getLogger("sslkit")

#: Row groups kept decoded per process (a row group of images can be tens of MB).
KEEP_GROUPS = 2


def parquet_files(spec: str, remote: Remote) -> list[str]:
    """The Parquet files ``spec`` names: a brace pattern, one ``.parquet`` URL, or a prefix / glob the store lists
    (its ``*.parquet``, sorted; a saved dataset's ``data/`` folder too)."""
    if "{" in spec:
        return expand_braces(spec)
    if spec.endswith(".parquet"):
        return [spec]
    refuse_http_listing(spec, "https://host/train-{00000..00009}.parquet")
    if any(c in spec for c in "*?["):
        return remote.glob(spec)
    found = remote.glob(spec.rstrip("/") + "/*.parquet")
    return found or remote.glob(spec.rstrip("/") + "/**/*.parquet")


def _class_names(schema: Any, label_column: str | None) -> list[str]:
    """A ``ClassLabel`` column's names from the schema's Hugging Face metadata (none without)."""
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta or label_column is None:
        return []
    try:
        feature = json.loads(meta)["info"]["features"][label_column]
    except (KeyError, ValueError, TypeError):
        return []
    return list(feature.get("names") or []) if isinstance(feature, dict) else []


class RemoteParquet(Dataset):
    """The rows of Parquet files in object storage (a Hugging Face dataset's ``data/*.parquet``), each an image (an
    ``Image`` feature's ``{bytes, path}``, or bytes) and optionally an integer label, by global row index.

    At start each file's row-group sizes and label column are read (small ranged reads) and cached locally by the
    file's URL, size and ETag. A row is read from its row group (the image column's chunk, retried; the last
    :data:`KEEP_GROUPS` groups kept per process), or, with ``cache_gb`` > 0, from the file's local copy once it is
    fetched (in the background, on its first read; :class:`~sslkit.data.shard_cache.ShardCache`). Parquet rows are
    read a row group at a time: in a random order over files larger than the cache each row costs its group's
    read, so give ``data.cache_gb`` room for the dataset (or pack the images into tar shards, read one by one).
    """

    def __init__(self, spec: str, split: str = "train", image_column: str = "image", label_column: str | None = None,
                 channels: int | str = AUTO, storage_options: dict[str, Any] | None = None,
                 cache_dir: str | None = None, retries: Retries | None = None, cache_gb: float = 0.0) -> None:
        channels = channel_setting(channels)
        self.root, self.jpeg_bytes = spec, False
        self.image_column, self.label_column = image_column, label_column
        self.remote = Remote(url_protocol(spec), storage_options, retries)
        self.files = parquet_files(spec, self.remote)
        if not self.files:
            raise DataSourceError(f"{spec} names no Parquet file")
        metas = [self._meta(url, split, cache_dir) for url in self.files]
        self.groups = [m["groups"] for m in metas]
        self.starts = np.cumsum([0] + [int(m["groups"].sum()) for m in metas])
        self.group_starts = [np.cumsum(np.concatenate([[0], m["groups"]])) for m in metas]
        self.keys = [str(m["key"]) for m in metas]
        self.sizes = [int(m["size"]) for m in metas]
        self.classes = [str(c) for c in metas[0]["classes"]]
        self._labels = np.concatenate([m["labels"] for m in metas]) if label_column else None
        self.num_classes = len(self.classes) or (int(self._labels.max()) + 1 if self._labels is not None else 0)
        self.cache = ShardCache(cache_root(cache_dir) / "parquet", int(cache_gb * (1 << 30)), self.remote,
                                suffix=".parquet") if cache_gb > 0 else None
        self._kept: OrderedDict[tuple[int, int], list[Any]] = OrderedDict()
        self._open: dict[int, Any] = {}
        self.channels = resolve_channels(channels, self.native_channels, len(self), spec)
        self._kept.clear()  # a file opened to count the channels stays in this process: a forked loader worker
        self._open.clear()  # that shared its connection would hang on it
        logger.info("data: %s: %d Parquet file(s), %d rows, images in '%s'%s", spec, len(self.files), len(self),
                    image_column, f", labels in '{label_column}' ({self.num_classes} classes)" if label_column
                    else ", no labels")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_kept"], state["_open"] = OrderedDict(), {}  # open files and decoded groups stay in their process
        return state

    def _meta(self, url: str, split: str, cache_dir: str | None) -> dict[str, Any]:
        """The file's row-group sizes, labels and class names, from the local cache or read (and cached)."""
        import pyarrow.parquet as pq

        size, tag = self.remote.identity(url)
        key = cache_key(url, (size, tag))
        cached = cache_root(cache_dir) / "parquet-index" / f"{key}-{self.label_column}.npz"
        if cached.is_file():
            with np.load(cached) as found:
                return {**{k: found[k] for k in found.files}, "key": key, "size": size}

        def read() -> dict[str, Any]:
            with self.remote.fs.open(url, "rb", block_size=1 << 20, cache_type="readahead") as f:
                pf = pq.ParquetFile(f)
                names = pf.schema_arrow.names
                for what, column in (("image_column", self.image_column), ("label_column", self.label_column)):
                    if column is not None and column not in names:
                        raise DataSourceError(f"{url} has no column '{column}' (data.{split}.kwargs.{what}); its "
                                              f"columns: {', '.join(names)}")
                groups = np.array([pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)], np.int64)
                labels = pf.read(columns=[self.label_column]).column(0).to_numpy().astype(np.int64) \
                    if self.label_column else np.zeros(0, np.int64)
                return {"groups": groups, "labels": labels,
                        "classes": np.array(_class_names(pf.schema_arrow, self.label_column))}

        try:
            meta = self.remote.call(f"reading the row groups of {url}", read)
        except RemoteReadError as e:
            raise DataSourceError(f"{url} cannot be read: {e}") from None
        except DataSourceError:
            raise
        except Exception as e:  # pyarrow's: not a Parquet file
            raise DataSourceError(f"{url} cannot be read as a Parquet file ({type(e).__name__}: {e})") from None
        cached.parent.mkdir(parents=True, exist_ok=True)
        np.savez(cached, **meta)
        return {**meta, "key": key, "size": size}

    @property
    def labels(self) -> Any:
        """Every row's label (read at start), or None without a label column."""
        return self._labels

    def __len__(self) -> int:
        """The rows over all files."""
        return int(self.starts[-1])

    def _group(self, f: int, g: int) -> list[Any]:
        """Row group ``g`` of file ``f``'s image column, decoded to Python values (kept: the last few)."""
        if (f, g) in self._kept:
            self._kept.move_to_end((f, g))
            return self._kept[(f, g)]
        import pyarrow.parquet as pq

        url = self.files[f]
        local = self.cache.local(url, self.keys[f], self.sizes[f]) if self.cache is not None else None
        if local is not None:
            values = pq.ParquetFile(local, memory_map=True).read_row_group(g, columns=[self.image_column])
        else:
            def read() -> Any:
                if f not in self._open:
                    self._open[f] = pq.ParquetFile(self.remote.fs.open(url, "rb", block_size=1 << 20,
                                                                       cache_type="none"))
                try:
                    return self._open[f].read_row_group(g, columns=[self.image_column])
                except BaseException:
                    self._open.pop(f, None)  # opened again on the retry
                    raise

            try:
                values = self.remote.call(f"reading row group {g} of {url}", read)
            except RemoteReadError as e:
                raise RemoteReadError(f"row group {g} of {url} cannot be read ({e}). The run stops here rather than "
                                      "train on other samples than it should; once the store answers again, the "
                                      "same command resumes from the last checkpoint") from None
        self._kept[(f, g)] = values.column(0).to_pylist()
        while len(self._kept) > KEEP_GROUPS:
            self._kept.popitem(last=False)
        return self._kept[(f, g)]

    def _encoded(self, i: int) -> tuple[bytes, str]:
        """Row ``i``'s image bytes and where they are (a row without bytes raises :class:`UnreadableSampleError`)."""
        f = int(np.searchsorted(self.starts, i, side="right")) - 1
        row = int(i - self.starts[f])
        g = int(np.searchsorted(self.group_starts[f], row, side="right")) - 1
        value = self._group(f, g)[row - int(self.group_starts[f][g])]
        where = f"row {row} of {self.files[f]}"
        data = value.get("bytes") if isinstance(value, dict) else value
        if not isinstance(data, bytes | bytearray) or not data:
            raise UnreadableSampleError(f"{where} has no image bytes in '{self.image_column}' (a path into the "
                                        "remote dataset is not followed)", where)
        return bytes(data), where

    def native_channels(self, i: int) -> int:
        """The channels row ``i``'s image holds (:func:`~sslkit.data.sources.encoded_channels`); a read that fails
        after every retry stops the build."""
        try:
            data, where = self._encoded(i)
        except RemoteReadError as e:
            raise DataSourceError(f"{self.root}: {e}") from None
        return encoded_channels(data, where)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """Row ``i``'s image as ``[C, H, W]`` (or a JPEG's bytes) and its label (-1 without labels)."""
        data, where = self._encoded(i)
        label = int(self._labels[i]) if self._labels is not None else -1
        return decode_image(data, self.channels, self.jpeg_bytes, where, where), label

