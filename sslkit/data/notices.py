"""Data warnings said once per run, across its processes and loader workers: one marker file each in the run
folder (``notices/``), which the run's report lists."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["FOLDER", "forget", "kept_in", "read_notices", "say_once"]

logger = logging.getLogger("sslkit.data")

#: The run folder's subfolder of notices.
FOLDER = "notices"

_folder: Path | None = None  # the running run's notices folder (None: no run, say once per process)
_said: set[str] = set()  # what this process has said (a forked loader worker inherits it)


@contextlib.contextmanager
def kept_in(run_dir: str | os.PathLike[str]) -> Iterator[None]:
    """While the block runs, notices are said once for the run in ``run_dir``: the first process (rank or loader
    worker) to create ``run_dir/notices/<key>.txt`` logs the warning, the others, and a resumed sitting, do not."""
    global _folder
    before, _folder = _folder, Path(run_dir) / FOLDER
    try:
        yield
    finally:
        _folder = before


def say_once(key: str, message: str) -> bool:
    """Log ``message`` as a warning unless notice ``key`` (a file name: letters, digits, ``-``) was said already, in
    this process or, within :func:`kept_in`, in this run; returns whether it was said now. A notice folder that
    cannot be written costs the once-per-run guarantee, never the warning."""
    if key in _said:
        return False
    _said.add(key)
    if _folder is not None:
        try:
            _folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(_folder / f"{key}.txt", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError:
            pass
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(message + "\n")
    logger.warning("%s", message)
    return True


def forget() -> None:
    """Forget what this process has said (a long-lived process, such as a test session, that runs many runs)."""
    _said.clear()


def read_notices(run_dir: str | os.PathLike[str]) -> list[str]:
    """The notices a run said (:func:`say_once` within :func:`kept_in`), in the order of their keys."""
    folder = Path(run_dir) / FOLDER
    if not folder.is_dir():
        return []
    return [p.read_text(encoding="utf-8").strip() for p in sorted(folder.glob("*.txt"))]
