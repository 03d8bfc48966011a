"""Whole remote shards kept on local disk (``data.cache_gb``): a shard is fetched in the background the first time one
of its samples is read (that sample and the next come by ranged reads meanwhile), then read from disk; the least
recently read shards go past the size limit. The loader workers of a machine share it: one fetches a shard, under a
lock, and the others read ranges until it is there."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sslkit.data.remote import Remote, RemoteReadError

__all__ = ["ShardCache"]

logger = logging.getLogger("sslkit")


class ShardCache:
    """Local copies of remote files under ``root`` (``<key><suffix>``, ``key`` the file's URL, size and ETag: tar
    shards, Parquet files), at most ``max_bytes`` of them; ``fetchers`` background downloads at a time in each
    process.

    :meth:`local` answers where a shard can be read from now: its local copy, or None (then it starts the copy's
    fetch, unless it is there or another process holds the fetch's lock, and the caller reads the range remotely).
    A fetch writes ``<key>.tar.part`` under an exclusive ``flock`` (a fetcher that died leaves the lock free: the
    next one starts again), checks its size and renames it into place. Reading a copy touches it; a fetch that
    completes removes the least recently touched copies past ``max_bytes`` (never the one just fetched).
    """

    def __init__(self, root: Path, max_bytes: int, remote: Remote, fetchers: int = 2, suffix: str = ".tar") -> None:
        self.root = Path(root)
        self.suffix = suffix
        self.max_bytes = int(max_bytes)
        self.remote = remote
        self.fetchers = fetchers
        self.fetched = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state.update(_pool=None, _pid=-1, _busy=set(), _lock=None)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pid != os.getpid():  # threads do not cross a fork: this process's own
            self._pool, self._pid, self._busy, self._lock = (
                ThreadPoolExecutor(self.fetchers, thread_name_prefix="sslkit-shard-fetch"), os.getpid(), set(),
                threading.Lock())
        return self._pool

    def local(self, url: str, key: str, size: int) -> Path | None:
        """The local copy of ``url`` (its cache ``key``, its ``size``) when it is complete, touched; else None, its
        fetch started in the background."""
        path = self.root / f"{key}{self.suffix}"
        try:
            os.utime(path)
            return path
        except FileNotFoundError:
            pass
        pool = self._executor()
        with self._lock:
            if key in self._busy:
                return None
            self._busy.add(key)
        pool.submit(self._fetch, url, key, size)
        return None

    def _fetch(self, url: str, key: str, size: int) -> None:
        path = self.root / f"{key}{self.suffix}"
        part = self.root / f"{key}{self.suffix}.part"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(part, "ab") as held:
                try:
                    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # another process fetches it
                if path.is_file():  # fetched meanwhile by another process
                    part.unlink(missing_ok=True)
                    return
                self.remote.call(f"fetching {url}", lambda: self.remote.fs.get_file(url, str(part)))
                got = part.stat().st_size
                if got != size:
                    raise RemoteReadError(f"{url}: {got} of its {size} bytes arrived")
                os.replace(part, path)
            self.fetched += 1
            self._evict(keep=path)
        except (RemoteReadError, OSError) as exc:  # the ranged reads go on; a later read tries the fetch again
            logger.warning("data: the local copy of %s could not be made (%s); its samples are read by ranges", url,
                           exc)
            part.unlink(missing_ok=True)
        finally:
            with self._lock:
                self._busy.discard(key)

    def _evict(self, keep: Path) -> None:
        """Remove the least recently read copies until the cache holds at most ``max_bytes`` (``keep`` stays)."""
        copies = []
        for p in self.root.glob(f"*{self.suffix}"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            copies.append((st.st_mtime_ns, st.st_size, p))
        total = sum(size for _, size, _ in copies)
        for _, size, p in sorted(copies):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            p.unlink(missing_ok=True)  # a reader that has it open reads on; the next one fetches it again
            total -= size
