"""Checkpoint files: atomic writes, a pointer to the latest, keep-last-N, fallback on corruption."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch
from iopath.common.file_io import g_pathmgr

__all__ = ["atomic_write", "checkpoint_dir", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger("sslkit")

LATEST = "latest.txt"
_NAME = re.compile(r"^checkpoint_(\d+)\.pt$")


def checkpoint_dir(output_dir: str) -> str:
    """The folder that holds the checkpoints of the run in ``output_dir``."""
    return os.path.join(output_dir, "checkpoints")


def atomic_write(path: str, write: Any) -> None:
    """Write through ``write(f)`` into a temporary file, fsync it, then rename over ``path``."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _list(ckpt_dir: str) -> list[tuple[int, str]]:
    """(iteration, file name) of every complete checkpoint in ``ckpt_dir``, oldest first."""
    if not g_pathmgr.exists(ckpt_dir):
        return []
    found = [(int(m.group(1)), n) for n in g_pathmgr.ls(ckpt_dir) if (m := _NAME.match(n))]
    return sorted(found)


def save_checkpoint(state: dict[str, Any], ckpt_dir: str, iteration: int, keep_last: int = 3) -> str:
    """Save ``state`` as ``checkpoint_<iteration>.pt`` atomically, then point ``latest.txt`` at it.

    The pointer is written last, so a crash at any moment leaves the previous checkpoint and
    pointer intact. Checkpoints beyond the ``keep_last`` newest are deleted (0 keeps all).
    """
    os.makedirs(ckpt_dir, exist_ok=True)
    name = f"checkpoint_{iteration:09d}.pt"
    path = os.path.join(ckpt_dir, name)
    atomic_write(path, lambda f: torch.save(state, f))
    atomic_write(os.path.join(ckpt_dir, LATEST), lambda f: f.write(name.encode()))
    if keep_last > 0:
        for _, old in _list(ckpt_dir)[:-keep_last]:
            if old != name:
                os.remove(os.path.join(ckpt_dir, old))
    return path


def latest_checkpoint(ckpt_dir: str) -> str | None:
    """Path of the checkpoint ``latest.txt`` names (or of the newest file), None if there is none."""
    pointer = os.path.join(ckpt_dir, LATEST)
    if g_pathmgr.exists(pointer):
        with g_pathmgr.open(pointer, "r") as f:
            name = f.read().strip()
        if name and g_pathmgr.exists(os.path.join(ckpt_dir, name)):
            return os.path.join(ckpt_dir, name)
    found = _list(ckpt_dir)
    return os.path.join(ckpt_dir, found[-1][1]) if found else None


def load_checkpoint(ckpt_dir: str, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], str] | None:
    """Load the latest readable checkpoint in ``ckpt_dir``: ``(state, path)``, or None if none exists.

    A latest checkpoint that cannot be read (truncated, corrupt) is reported and the next
    older one is tried.
    """
    latest = latest_checkpoint(ckpt_dir)
    if latest is None:
        return None
    candidates = [latest] + [
        os.path.join(ckpt_dir, n) for _, n in reversed(_list(ckpt_dir)) if os.path.join(ckpt_dir, n) != latest
    ]
    for path in candidates:
        try:
            with g_pathmgr.open(path, "rb") as f:
                state = torch.load(f, map_location=map_location, weights_only=False)
            return state, path
        except Exception as exc:  # a truncated or corrupt file: fall back to an older one
            logger.error("checkpoint %s is unreadable (%s: %s); trying an older one", path,
                         type(exc).__name__, exc)
    raise RuntimeError(
        f"no readable checkpoint in {ckpt_dir} ({len(candidates)} tried). Move the folder away to "
        "start afresh, or set checkpoint.auto_resume=false."
    )

