"""Tar shards in WebDataset's layout as a source (``data=webdataset``), on local disk or in object storage
(``s3://``, ``gs://``, ``https://``: :mod:`sslkit.data.remote`): an index of member offsets built once per shard and
cached, so every sample is read by its global index (the sampler, resume, elastic resume and per-sample seeds work as
for folders; a remote sample is one ranged read); and ``pack``, which writes a folder of images into such shards."""

from __future__ import annotations

import io
import logging
import os
import tarfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

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
    is_url,
    refuse_http_listing,
    url_protocol,
)
from sslkit.data.sampler import shard_windows
from sslkit.data.shard_cache import ShardCache
from sslkit.data.sources import (
    IMAGE_EXTENSIONS,
    DataSourceError,
    UnreadableSampleError,
    decode_image,
    encoded_channels,
    save_arrays,
)
from sslkit.registry import register_dataset

__all__ = ["INDEX_SUFFIX", "Shard", "ShardDataset", "build_webdataset", "expand_shards", "pack_images",
           "remote_index", "shard_index", "upload_shard", "write_remote_index", "write_shards"]

logger = logging.getLogger("sslkit")

#: The index cached beside each shard: ``<shard>.tar`` -> ``<shard>.tar.sslkit-idx.npz``.
INDEX_SUFFIX = ".sslkit-idx.npz"
#: Bumped when the index's layout changes (an index of another version is rebuilt).
INDEX_VERSION = 1
#: A sample's image members, by extension (WebDataset's convention: ``<key>.<ext>``), and its label member.
IMAGE_EXTS = tuple(e.lstrip(".").lower() for e in IMAGE_EXTENSIONS)
LABEL_EXT = "cls"


#: A shard as :class:`ShardDataset` holds it: a local path, or a URL read through a :class:`Remote`.
Shard = Path | str


def expand_shards(spec: str, remote: Remote | None = None) -> list[Shard]:
    """The shard files ``spec`` names: a brace pattern (``/data/train-{000000..000099}.tar``,
    ``s3://bucket/train-{000000..000099}.tar``), a folder or a remote prefix (its ``*.tar``, sorted; a store that
    lists its files), a glob of a remote store, a text file listing one shard a line (local paths relative to its
    folder, or URLs), or one ``.tar``. URLs stay strings (read through ``remote``)."""
    if is_url(spec):
        if "{" in spec:
            return list(expand_braces(spec))
        if spec.endswith(".tar"):
            return [spec]
        if remote is None:
            raise DataSourceError(f"{spec}: a remote folder or glob is listed through its filesystem")
        refuse_http_listing(spec, "https://host/train-{000000..000099}.tar")
        return remote.glob(spec if any(c in spec for c in "*?[") else spec.rstrip("/") + "/*.tar")
    path = Path(spec).expanduser()
    if "{" in spec:
        return [Path(p).expanduser() for p in expand_braces(spec)]
    if path.is_dir():
        return sorted(path.glob("*.tar"))
    if path.is_file() and path.suffix != ".tar":
        lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        return [ln if is_url(ln) else Path(ln) if Path(ln).is_absolute() else path.parent / ln for ln in lines]
    return [path]


def _scan(shard: Shard, fileobj: IO[bytes] | None = None) -> dict[str, np.ndarray]:
    """Read ``shard``'s tar headers once (from ``fileobj`` when given: a remote shard read in blocks): per sample
    (members grouped by the name before the first dot), the offset and size of its image member, its extension and
    its label (-1 without a ``.cls`` member)."""
    samples: dict[str, dict[str, object]] = {}
    order: list[str] = []
    try:
        with tarfile.open(None if fileobj is not None else shard, "r:", fileobj=fileobj) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                name = os.path.basename(member.name)
                key, _, ext = name.partition(".")
                prefix = os.path.dirname(member.name)
                key = f"{prefix}/{key}" if prefix else key
                ext = ext.lower()
                entry = samples.get(key)
                if entry is None:
                    entry = samples[key] = {}
                    order.append(key)
                if ext in IMAGE_EXTS and "offset" not in entry:
                    entry.update(offset=member.offset_data, size=member.size, ext=ext)
                elif ext == LABEL_EXT:
                    text = tar.extractfile(member).read().decode(errors="replace").strip()  # type: ignore[union-attr]
                    if not text.lstrip("-").isdigit():
                        raise DataSourceError(f"shard {shard}: {member.name} holds {text[:20]!r}, not an integer "
                                              "class label")
                    entry["label"] = int(text)
    except RemoteReadError:
        raise
    except (tarfile.TarError, OSError, ValueError, EOFError) as e:
        raise DataSourceError(f"shard {shard} cannot be read as a tar file ({type(e).__name__}: {e}): it is "
                              "truncated or damaged; copy it again or leave it out of the pattern") from None
    keys = [k for k in order if "offset" in samples[k]]
    if not keys:
        raise DataSourceError(f"shard {shard} holds no image member (<key>.{'/'.join(IMAGE_EXTS[:4])}...): not a "
                              "shard of images")
    size, mtime = (-1, -1) if fileobj is not None else (Path(shard).stat().st_size, Path(shard).stat().st_mtime_ns)
    return {"version": np.array(INDEX_VERSION), "size": np.array(size), "mtime_ns": np.array(mtime),
            "offsets": np.array([samples[k]["offset"] for k in keys], dtype=np.int64),
            "sizes": np.array([samples[k]["size"] for k in keys], dtype=np.int64),
            "labels": np.array([samples[k].get("label", -1) for k in keys], dtype=np.int64),
            "keys": np.array(keys)}


def shard_index(shard: Path) -> dict[str, np.ndarray]:
    """``shard``'s index, read from ``<shard>.sslkit-idx.npz`` when it matches the shard's size and modification time
    (and this index version), else built (:func:`_scan`) and written there (atomically; where the folder is not
    writable it is only kept in memory). A missing shard is a :class:`DataSourceError` naming it."""
    if not shard.is_file():
        raise DataSourceError(f"shard {shard} does not exist: check the pattern, or leave the shard out")
    cached = Path(f"{shard}{INDEX_SUFFIX}")
    stat = shard.stat()
    if cached.is_file():
        try:
            with np.load(cached) as found:
                index = {k: found[k] for k in found.files}
            if (int(index["version"]) == INDEX_VERSION and int(index["size"]) == stat.st_size
                    and int(index["mtime_ns"]) == stat.st_mtime_ns):
                return index
            logger.info("data: the index of %s is older than the shard (or of another version): rebuilt", shard)
        except (OSError, ValueError, KeyError):
            logger.info("data: the index of %s cannot be read: rebuilt", shard)
    index = _scan(shard)
    try:
        save_arrays(cached, index)
    except OSError as e:
        logger.info("data: the index of %s is not cached (%s): built again by the next run", shard, e)
    return index


def _read_index(data: bytes | Path) -> dict[str, np.ndarray] | None:
    """An index file's arrays (from its bytes or its path), or None when it cannot be read or is of another
    version."""
    try:
        with np.load(io.BytesIO(data) if isinstance(data, bytes) else data) as found:
            index = {k: found[k] for k in found.files}
        return index if int(index["version"]) == INDEX_VERSION else None
    except (OSError, ValueError, KeyError, EOFError):
        return None


def _save_index(index: dict[str, np.ndarray], path: Path) -> None:
    """Write ``index`` to ``path`` atomically (a folder that cannot be written only loses the cache)."""
    try:
        save_arrays(path, index)
    except OSError as e:
        logger.info("data: the index %s is not cached (%s): built again by the next run", path, e)


def remote_index(url: str, remote: Remote, cache_dir: str | None = None) -> dict[str, np.ndarray]:
    """The index of the remote shard ``url``, cached locally under ``cache_root(cache_dir)/shard-index/`` by the
    shard's URL, size and ETag (a shard changed in place is indexed again). Not cached yet: the index file beside the
    shard (``<shard>.sslkit-idx.npz``, which ``sslkit data pack`` writes) when it is there and of the shard's size,
    else the shard's tar headers read in blocks (the whole shard once, for shards of small images)."""
    identity = remote.identity(url)
    cached = cache_root(cache_dir) / "shard-index" / f"{cache_key(url, identity)}.npz"
    if cached.is_file():
        index = _read_index(cached)
        if index is not None:
            return index
    index = None
    beside = f"{url}{INDEX_SUFFIX}"
    if remote.exists(beside):
        index = _read_index(remote.call(f"reading {beside}", lambda: remote.fs.cat_file(beside)))
        if index is not None and int(index["size"]) not in (identity[0], -1):
            logger.info("data: the index beside %s is of another size of the shard: it is read again", url)
            index = None
    if index is None:
        logger.info("data: indexing %s (its tar headers, read in blocks)", url)
        with remote.open(url) as f:
            index = _scan(url, f)
    index["size"], index["mtime_ns"], index["etag"] = np.array(identity[0]), np.array(-1), np.array(identity[1])
    _save_index(index, cached)
    return index


class ShardDataset(Dataset):
    """The images of tar shards (WebDataset's layout: ``<key>.jpg`` and an optional ``<key>.cls`` label per
    sample), addressed by a global index over the shards in order, through the index of member offsets each shard
    has beside it (:func:`shard_index`; a remote shard's: :func:`remote_index`). A read is one seek and one read of
    the member (a remote one: one ranged request, retried with backoff); a member that does not decode raises
    :class:`UnreadableSampleError` (skipped and counted), a remote read that fails after every retry
    :class:`~sslkit.data.remote.RemoteReadError` (the run stops, to resume once the store answers); a missing,
    truncated or empty shard stops the run when the dataset is built, naming it. ``storage_options``: the remote
    filesystem's arguments (never logged)."""

    def __init__(self, spec: str, channels: int | str = AUTO, storage_options: dict[str, Any] | None = None,
                 cache_dir: str | None = None, retries: Retries | None = None, cache_gb: float = 0.0) -> None:
        channels = channel_setting(channels)
        first = spec if is_url(spec) else None
        self.remote = Remote(url_protocol(first), storage_options, retries) if first else None
        self.shards = expand_shards(spec, self.remote)
        if self.remote is None and any(is_url(s) for s in self.shards):  # a list file of URLs
            protocol = url_protocol(str(next(s for s in self.shards if is_url(s))))
            self.remote = Remote(protocol, storage_options, retries)
        if not self.shards:
            raise DataSourceError(f"{spec} names no shard: give a brace pattern (train-{{000000..000099}}.tar), a "
                                  "folder of .tar files or a list file")
        indexes = [self._index(s, cache_dir) for s in self.shards]
        #: Whole remote shards kept locally (``cache_gb`` > 0), and each shard's key and size there.
        self.shard_cache = ShardCache(cache_root(cache_dir) / "shards", int(cache_gb * (1 << 30)), self.remote) \
            if self.remote is not None and cache_gb > 0 else None
        self.copy_keys = [cache_key(str(s), (int(ix["size"]), str(ix["etag"]))) if "etag" in ix else ""
                          for s, ix in zip(self.shards, indexes, strict=True)]
        self.shard_sizes = [int(ix["size"]) for ix in indexes]
        self.offsets = [ix["offsets"] for ix in indexes]
        self.sizes = [ix["sizes"] for ix in indexes]
        self.labels = np.concatenate([ix["labels"] for ix in indexes])
        self.starts = np.cumsum([0] + [len(o) for o in self.offsets])
        self.jpeg_bytes = False
        labelled = self.labels >= 0
        if labelled.any() and not labelled.all():
            raise DataSourceError(f"{spec}: {int((~labelled).sum())} of {len(self.labels)} samples have no .cls label "
                                  "and the others have one: label every sample or none")
        self.num_classes = int(self.labels.max()) + 1 if labelled.all() else 0
        count = self.native_channels
        if self.remote is not None:  # one ranged read now: a store that cannot serve them stops here, not per sample
            try:
                first = int(self.offsets[0][0])
                head = self.remote.read(str(self.shards[0]), first, first + int(self.sizes[0][0]))
            except RemoteReadError as e:
                raise DataSourceError(f"shard {self.shards[0]}: {e}") from None
            where = f"sample 0 of shard {self.shards[0]}"

            def count(i: int) -> int:  # sample 0's bytes are here already: no second request for them
                return encoded_channels(head, where) if i == 0 else self.native_channels(i)
        self.channels = resolve_channels(channels, count, len(self), spec)
        logger.info("data: %d shard(s) from %s: %d samples%s", len(self.shards), spec, len(self),
                    f", {self.num_classes} classes" if self.num_classes else ", no labels")

    def _index(self, shard: Shard, cache_dir: str | None) -> dict[str, np.ndarray]:
        if not is_url(shard):
            return shard_index(Path(shard))
        assert self.remote is not None
        if url_protocol(str(shard)) != self.remote.protocol:
            raise DataSourceError(f"shard {shard}: the shards of one source are read through one filesystem "
                                  f"({self.remote.protocol}://)")
        try:
            return remote_index(str(shard), self.remote, cache_dir)
        except RemoteReadError as e:
            raise DataSourceError(f"shard {shard} cannot be read: {e}") from None

    def native_channels(self, i: int) -> int:
        """The channels sample ``i``'s member holds (:func:`~sslkit.data.sources.encoded_channels`); a remote read
        that fails after every retry stops the build, naming the shard."""
        shard, j = self.locate(i)
        try:  # a remote member by one ranged read, not through the shard cache (no fetch started before a fork)
            url = str(self.shards[shard])
            data = self._read_remote(url, shard, j, int(self.offsets[shard][j])) if is_url(url) else self.raw(i)
        except RemoteReadError as e:
            raise DataSourceError(f"shard {self.shards[shard]}: {e}") from None
        return encoded_channels(data, f"sample {j} of shard {self.shards[shard]}")

    def __len__(self) -> int:
        """The samples over all shards."""
        return int(self.starts[-1])

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, member) of global sample ``i``."""
        shard = int(np.searchsorted(self.starts, i, side="right")) - 1
        return shard, int(i - self.starts[shard])

    def plan_windows(self, seed: int, span: int) -> None:
        """Read ahead in ``data.order=shards`` (the sampler's ``seed`` and ``span``): with local copies of whole shards
        (``cache_gb``), a batch of one window starts the fetch of the next window's shards
        (:func:`~sslkit.data.sampler.shard_windows`, the sampler's own order)."""
        self._plan = (int(seed), int(span))
        if self.shard_cache is not None:
            need = 2 * span * max(self.shard_sizes)
            if self.shard_cache.max_bytes < need:
                logger.warning("data: data.cache_gb holds %.2f GB and two windows of %d shards take up to %.2f GB: "
                               "the next window's shards would push out the current ones; raise data.cache_gb",
                               self.shard_cache.max_bytes / (1 << 30), span, need / (1 << 30))

    def _read_ahead(self, indices: Sequence[int], epoch: int) -> None:
        """Start the fetch of the shards of the window after the one ``indices`` are in (this epoch's order)."""
        if self.shard_cache is None or getattr(self, "_plan", None) is None or not len(indices):
            return
        seed, span = self._plan
        if getattr(self, "_windows", (None,))[0] != epoch:
            self._windows = (epoch, shard_windows(len(self.shards), span, seed + epoch))
        windows = self._windows[1]
        shard = self.locate(int(indices[0]))[0]
        w = next((k for k, window in enumerate(windows) if shard in window), len(windows))
        for nxt in windows[w + 1] if w + 1 < len(windows) else []:
            if is_url(self.shards[nxt]) and self.copy_keys[nxt]:
                self.shard_cache.local(str(self.shards[nxt]), self.copy_keys[nxt], self.shard_sizes[nxt])

    def prefetch(self, indices: Sequence[int], epoch: int | None = None) -> None:
        """Read the remote samples among ``indices`` at once (concurrent ranged requests, retried as a whole), for
        :meth:`raw` to take: a batch costs about one round trip instead of one per sample. Samples whose shard has a
        local copy, and local shards, are left to :meth:`raw`. Only the last call's samples are kept. With ``epoch``
        and :meth:`plan_windows`, the next window's shards are fetched meanwhile."""
        self._ahead: dict[int, bytes] = {}
        if self.remote is None:
            return
        if epoch is not None:
            self._read_ahead(indices, epoch)
        wanted, copies = [], {}
        for i in dict.fromkeys(int(i) for i in indices):
            shard, j = self.locate(i)
            if shard not in copies:  # a shard with a local copy is read from it; one without starts its fetch here
                copies[shard] = self.shard_cache.local(str(self.shards[shard]), self.copy_keys[shard],
                                                       self.shard_sizes[shard]) \
                    if self.shard_cache is not None and self.copy_keys[shard] else None
            if is_url(self.shards[shard]) and copies[shard] is None:
                start = int(self.offsets[shard][j])
                wanted.append((i, str(self.shards[shard]), start, start + int(self.sizes[shard][j])))
        if len(wanted) < 2:
            return
        try:
            self._ahead = dict(zip((w[0] for w in wanted), self.remote.read_many([w[1:] for w in wanted]),
                                   strict=True))
        except RemoteReadError:
            self._ahead = {}  # each sample is read alone then, and a failure is named there

    def raw(self, i: int) -> bytes:
        """The encoded image of sample ``i``, as stored."""
        ahead = getattr(self, "_ahead", None)
        if ahead and i in ahead:
            return ahead.pop(i)
        shard, j = self.locate(i)
        path = self.shards[shard]
        if self.remote is not None and is_url(path):
            start = int(self.offsets[shard][j])
            local = self.shard_cache.local(str(path), self.copy_keys[shard], self.shard_sizes[shard]) \
                if self.shard_cache is not None and self.copy_keys[shard] else None
            if local is not None:
                path = local  # the whole shard on local disk: read below as a local shard's member
            else:
                return self._read_remote(str(path), shard, j, start)
        try:
            with open(path, "rb") as f:
                f.seek(int(self.offsets[shard][j]))
                data = f.read(int(self.sizes[shard][j]))
        except OSError as e:
            raise UnreadableSampleError(f"cannot read sample {j} of shard {path}: {e}", str(path)) from e
        if len(data) != int(self.sizes[shard][j]):
            raise UnreadableSampleError(f"sample {j} of shard {path} is cut short (the shard changed?)", str(path))
        return data

    def _read_remote(self, url: str, shard: int, j: int, start: int) -> bytes:
        assert self.remote is not None
        try:
            return self.remote.read(url, start, start + int(self.sizes[shard][j]))
        except RemoteReadError as e:  # not a bad sample to skip: the store is unreachable, or the shard is gone
            raise RemoteReadError(f"sample {j} of shard {url} cannot be read ({e}). The run stops here rather than "
                                  "train on other samples than it should; once the store answers again, the same "
                                  "command resumes from the last checkpoint") from None

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """Sample ``i``'s image as ``[C, H, W]`` (uint8, or uint16 for 16-bit members; a JPEG's bytes with
        :attr:`jpeg_bytes`) and its label."""
        data, label = self.raw(i), int(self.labels[i])
        shard, j = self.locate(i)
        where = f"sample {j} of shard {self.shards[shard]}"
        return decode_image(data, self.channels, self.jpeg_bytes, where, str(self.shards[shard])), label


@register_dataset("webdataset")
def build_webdataset(split: str, path: str | None = None, channels: int | str = AUTO,
                     storage_options: dict[str, Any] | None = None, cache_dir: str | None = None,
                     retries: dict[str, Any] | None = None, cache_gb: float = 0.0) -> ShardDataset:
    """Tar shards (``data=webdataset``): ``path`` a brace pattern, a folder of ``.tar`` files or a list file, local
    or remote (``s3://``, ``gs://``, ``https://``; ``storage_options``, ``cache_dir`` and ``retries``
    (:class:`~sslkit.data.remote.Retries`' fields) and ``cache_gb`` (whole shards kept on local disk:
    :class:`~sslkit.data.shard_cache.ShardCache`): ``data.storage_options``, ``data.cache_dir``, ``data.read_attempts``,
    ``data.read_backoff_s`` and ``data.cache_gb``, which the builder passes)."""
    if not path:
        raise DataSourceError(f"the 'webdataset' source needs shards: set data.{split}.path to a brace pattern, a "
                              "folder of .tar files or a list file")
    try:
        return ShardDataset(path, channels, storage_options, cache_dir, Retries(**retries) if retries else None,
                            cache_gb)
    except DataSourceError as e:
        raise DataSourceError(f"data.{split}.path: {e}") from None


def write_shards(items: Iterable[tuple[str, bytes, int]], output: Path, shard_bytes: int = 256 << 20,
                 prefix: str = "shard", on_shard: Callable[[Path], None] | None = None) -> list[Path]:
    """Write ``items`` (extension, encoded image, label; label -1: none) into tar shards
    ``<output>/<prefix>-NNNNNN.tar`` of about ``shard_bytes`` each, in order: item ``k`` is ``<k:09d>.<ext>`` with the
    bytes as they are and ``<k:09d>.cls`` with its label; each shard's index is written beside it as soon as the
    shard is complete, and ``on_shard(shard)`` called then (an upload can take it, and remove it). Returns the
    shards."""
    output.mkdir(parents=True, exist_ok=True)
    shards: list[Path] = []
    tar: tarfile.TarFile | None = None
    written = 0

    def add(name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        assert tar is not None
        tar.addfile(info, io.BytesIO(data))

    def close() -> None:
        assert tar is not None
        tar.close()
        shard_index(shards[-1])
        if on_shard is not None:
            on_shard(shards[-1])

    for k, (ext, data, label) in enumerate(items):
        if tar is None or written >= shard_bytes:
            if tar is not None:
                close()
            shards.append(output / f"{prefix}-{len(shards):06d}.tar")
            tar, written = tarfile.open(shards[-1], "w", format=tarfile.USTAR_FORMAT), 0
        add(f"{k:09d}.{ext}", data)
        if label >= 0:
            add(f"{k:09d}.{LABEL_EXT}", str(label).encode())
        written += len(data) + 1024
    if tar is not None:
        close()
    return shards


def pack_images(files: Sequence[tuple[str, int]], output: Path, shard_bytes: int = 256 << 20,
                prefix: str = "shard", on_shard: Callable[[Path], None] | None = None) -> list[Path]:
    """Write the image files ``files`` (path, label) into shards with :func:`write_shards`, each file's bytes as they
    are (nothing re-encoded) under its own extension. Returns the shards."""
    items = ((Path(f).suffix.lstrip(".").lower() or "jpg", Path(f).read_bytes(), label) for f, label in files)
    return write_shards(items, output, shard_bytes, prefix, on_shard)


def upload_shard(shard: Path, url_prefix: str, remote: Remote) -> str:
    """Upload ``shard`` and its index beside it to ``url_prefix`` (a remote folder), then remove the local files;
    returns the shard's URL."""
    url = f"{url_prefix.rstrip('/')}/{shard.name}"
    index = Path(f"{shard}{INDEX_SUFFIX}")
    remote.put(shard, url)
    if index.is_file():
        remote.put(index, f"{url}{INDEX_SUFFIX}")
        index.unlink()
    shard.unlink()
    return url


def write_remote_index(url: str, remote: Remote, cache_dir: str | None = None) -> str:
    """Write the remote shard ``url``'s index beside it (``<url>.sslkit-idx.npz``: what every later reader fetches in
    one request instead of reading the tar headers); returns the index's URL."""
    index = remote_index(url, remote, cache_dir)
    local = cache_root(cache_dir) / "shard-index" / f"upload-{os.getpid()}{INDEX_SUFFIX}"
    _save_index(index, local)
    remote.put(local, f"{url}{INDEX_SUFFIX}")
    local.unlink()
    return f"{url}{INDEX_SUFFIX}"
