"""Files written whole or not at all: a reader (a resumed run, a tool, a person) never meets half of one."""

from __future__ import annotations

import contextlib
import os
from typing import Any

__all__ = ["atomic_write"]


def atomic_write(path: str, write: Any) -> None:
    """Write through ``write(f)`` into a temporary file, fsync it, then rename over ``path``."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal, a bug: never leave a half-written file behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
