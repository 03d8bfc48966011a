"""Data in object storage (``s3://``, ``gs://``, ``https://``, any fsspec URL): a filesystem opened in each process
from the URL and ``data.storage_options``, byte ranges read with retries and backoff, and the identity of a remote
file (size, ETag) that keys what is cached of it locally."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sslkit.data.sources import DataSourceError

__all__ = ["Remote", "RemoteReadError", "Retries", "cache_root", "expand_braces", "is_url", "refuse_http_listing",
           "url_protocol"]

logger = logging.getLogger("sslkit")

T = TypeVar("T")

#: What a scheme needs installed, and the extra that brings it.
_NEEDS = {"s3": ("s3fs", "sslkit[remote]"), "s3a": ("s3fs", "sslkit[remote]"), "gs": ("gcsfs", "gcsfs"),
          "gcs": ("gcsfs", "gcsfs"), "http": ("aiohttp", "sslkit[remote]"), "https": ("aiohttp", "sslkit[remote]")}


def is_url(spec: Any) -> bool:
    """Whether ``spec`` names a remote location (``scheme://...``; ``file://`` and plain paths are local)."""
    return isinstance(spec, str) and "://" in spec and not spec.startswith("file://")


def url_protocol(url: str) -> str:
    """The scheme of ``url`` (``s3``, ``gs``, ``https``, ...)."""
    return url.split("://", 1)[0].lower()


def expand_braces(spec: str) -> list[str]:
    """The names a brace pattern (``train-{000000..000099}.tar``) stands for, in order, through webdataset's
    ``braceexpand`` (a message naming the extra when it is not installed)."""
    try:
        from braceexpand import braceexpand
    except ImportError:
        raise DataSourceError(f"{spec} is a brace pattern, expanded by webdataset's braceexpand, which is not "
                              "installed: pip install 'sslkit[webdataset]' (or give a folder of files or a "
                              "list file)") from None
    return list(braceexpand(spec))


def refuse_http_listing(spec: str, example: str) -> None:
    """Stop on an ``http(s)://`` folder or glob, which a web server cannot list, naming what to give instead (a
    brace pattern such as ``example``)."""
    if url_protocol(spec) in ("http", "https"):
        raise DataSourceError(f"{spec}: an HTTP server cannot list a folder; give a brace pattern ({example}) or "
                              "one file (or a list file of URLs)")


def cache_root(cache_dir: str | None = None) -> Path:
    """Where what is cached of remote data lives: ``cache_dir`` (``data.cache_dir``), else ``$SSLKIT_CACHE``, else
    ``$XDG_CACHE_HOME/sslkit`` (``~/.cache/sslkit``)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("SSLKIT_CACHE"):
        return Path(os.environ["SSLKIT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sslkit"


class RemoteReadError(DataSourceError):
    """A remote read that failed after every retry (or that cannot succeed: a missing file, a refused credential)."""


def _transient_errors() -> tuple[type[BaseException], ...]:
    """The errors of a flaky network, as fsspec's filesystems raise them: OSError (s3fs turns S3's errors into it),
    aiohttp's (HTTP), botocore's (S3 below s3fs), timeouts."""
    found: list[type[BaseException]] = [OSError, TimeoutError, ConnectionError]
    try:
        import aiohttp

        found.append(aiohttp.ClientError)
    except ImportError:
        pass
    try:
        import botocore.exceptions

        found.append(botocore.exceptions.BotoCoreError)
    except ImportError:
        pass
    return tuple(found)


#: The jitter's own generator: the global one (which a transform may draw from) is left alone.
_JITTER = random.Random()

#: Errors that no retry mends: the file is not there, or the credentials are refused.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError)


@dataclass(frozen=True)
class Retries:
    """How a remote read is retried: up to ``attempts`` tries, waiting ``base_s * 2**k`` (at most ``max_s``, with
    jitter) after the k-th failure."""

    attempts: int = 8
    base_s: float = 0.25
    max_s: float = 20.0

    def wait(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failures in a row."""
        return min(self.max_s, self.base_s * 2 ** (failures - 1)) * (0.5 + _JITTER.random() / 2)


class Remote:
    """One remote store as a process sees it: its fsspec filesystem (made in the process that uses it: a filesystem
    made before a fork is not used after it, and none is pickled), its reads retried.

    ``storage_options`` go to the filesystem as fsspec takes them (``key``, ``secret``, ``endpoint_url``,
    ``client_kwargs``, ``anon``, ``token``, ...); they are never logged, and credentials are better left to the
    environment or a profile, where the libraries find them. :attr:`retried` counts the retries of this process.
    """

    def __init__(self, protocol: str, storage_options: dict[str, Any] | None = None,
                 retries: Retries | None = None) -> None:
        self.protocol = protocol
        self.storage_options = dict(storage_options or {})
        self.retries = retries or Retries()
        #: Requests in flight at once when a batch is read (:meth:`read_many`), per process.
        self.concurrency = 16
        self.retried = 0
        self._fs: Any = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fs"], state["_pid"] = None, -1
        return state

    def __repr__(self) -> str:
        return f"Remote({self.protocol}://)"  # never the storage options

    @property
    def fs(self) -> Any:
        """The filesystem, made once per process."""
        if self._fs is None or self._pid != os.getpid():
            self._fs, self._pid = self._open(), os.getpid()
        return self._fs

    def _open(self) -> Any:
        try:
            import fsspec

            return fsspec.filesystem(self.protocol, skip_instance_cache=True, **self.storage_options)
        except ImportError as exc:
            module, extra = _NEEDS.get(self.protocol, (str(exc.name), "the fsspec filesystem for it"))
            raise DataSourceError(f"{self.protocol}:// URLs are read through fsspec with {module}, which is not "
                                  f"installed: pip install '{extra}'") from None
        except (ValueError, TypeError) as exc:
            raise DataSourceError(f"{self.protocol}:// filesystem: {exc} (data.storage_options: the filesystem's "
                                  "own arguments)") from None

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried with backoff on a transient error; a permanent one (no such file, refused) or the last
        failure raises :class:`RemoteReadError` saying ``what`` failed."""
        transient = _transient_errors()
        failures = 0
        while True:
            try:
                return fn()
            except _PERMANENT as exc:
                raise RemoteReadError(f"{what}: {type(exc).__name__}: {exc}") from None
            except transient as exc:
                failures += 1
                if failures >= self.retries.attempts:
                    raise RemoteReadError(f"{what}: failed {failures} times, the last with {type(exc).__name__}: "
                                          f"{exc}") from None
                self.retried += 1
                wait = self.retries.wait(failures)
                logger.warning("data: %s failed (%s: %s); retry %d of %d in %.1f s", what, type(exc).__name__,
                               str(exc)[:200], failures, self.retries.attempts - 1, wait)
                time.sleep(wait)

    def read(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``url``: one ranged request, retried (a reply of another length, as a server that
        ignores byte ranges sends, is an error: never data from elsewhere in the file)."""
        def fetch() -> bytes:
            data = self.fs.cat_file(url, start=start, end=end)
            if len(data) != end - start:
                if len(data) > end - start:
                    raise RemoteReadError(f"{url}: asked for bytes {start}-{end - 1} and the server sent {len(data)} "
                                          "bytes: it ignores byte ranges (HTTP Range), which random access needs")
                raise OSError(f"{url}: bytes {start}-{end - 1}: {len(data)} of {end - start} arrived")
            return data

        return self.call(f"reading bytes {start}-{end - 1} of {url}", fetch)

    def read_many(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """Bytes ``[start, end)`` of each ``(url, start, end)``, requested concurrently (fsspec's ``cat_ranges``, at
        most :attr:`concurrency` at a time), the whole retried as one read; each reply's length checked as
        :meth:`read` does."""
        def fetch() -> list[bytes]:
            found = self.fs.cat_ranges([r[0] for r in ranges], [r[1] for r in ranges], [r[2] for r in ranges],
                                       batch_size=self.concurrency)
            for (url, start, end), data in zip(ranges, found, strict=True):
                if isinstance(data, BaseException):
                    raise data
                if len(data) > end - start:
                    raise RemoteReadError(f"{url}: asked for bytes {start}-{end - 1} and the server sent {len(data)} "
                                          "bytes: it ignores byte ranges (HTTP Range), which random access needs")
                if len(data) != end - start:
                    raise OSError(f"{url}: bytes {start}-{end - 1}: {len(data)} of {end - start} arrived")
            return list(found)

        return self.call(f"reading {len(ranges)} samples of {ranges[0][0]} and others", fetch)

    def identity(self, url: str) -> tuple[int, str]:
        """``url``'s size and a tag that changes when its content does (the ETag; the modification time where a
        store has no ETag), as one string for cache keys."""
        info = self.call(f"looking up {url}", lambda: self.fs.info(url))
        if info.get("type") == "directory":
            raise RemoteReadError(f"{url} is a folder, not a file")
        size = info.get("size")
        if size is None:
            raise RemoteReadError(f"{url}: the server does not say the file's size (Content-Length), which random "
                                  "access needs")
        tag = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
        return int(size), str(tag).strip('"')

    def open(self, url: str, block_size: int = 1 << 20) -> Any:
        """``url`` as a seekable file read in blocks of ``block_size`` (what a sequential scan reads through)."""
        return self.call(f"opening {url}", lambda: self.fs.open(url, "rb", block_size=block_size,
                                                                cache_type="readahead"))

    def exists(self, url: str) -> bool:
        """Whether ``url`` is there (retried; False for a missing one)."""
        try:
            return bool(self.call(f"looking up {url}", lambda: self.fs.exists(url)))
        except RemoteReadError:
            return False

    def put(self, local: str | Path, url: str) -> None:
        """Upload the file ``local`` to ``url`` (retried)."""
        self.call(f"writing {url}", lambda: self.fs.put_file(str(local), url))

    def glob(self, pattern: str) -> list[str]:
        """The URLs a glob matches, sorted, with their scheme (stores that can list their files)."""
        found = self.call(f"listing {pattern}", lambda: self.fs.glob(pattern))
        return sorted(f"{self.protocol}://{p}" if "://" not in p else p for p in found)


def cache_key(url: str, identity: tuple[int, str]) -> str:
    """A file name for what is cached of ``url`` as it is now (its size and ETag)."""
    return hashlib.sha1(f"{url}\n{identity[0]}\n{identity[1]}".encode()).hexdigest()
