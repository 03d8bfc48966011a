"""Checkpoints, one owner: the Checkpointer writes atomic files or sharded folders (async too), commits them through a
pointer to the latest, keeps the last N; it finds a run's latest committed checkpoint, reads it without running code
(falling back on corruption) and puts it back into the run, resharded and with every rank's RNG."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import re
import shutil
from typing import TYPE_CHECKING, Any

import torch
from iopath.common.file_io import g_pathmgr

from sslkit.checkpointing import sharded as sharded_checkpoint
from sslkit.checkpointing.sharded import (
    METADATA,
    RefusedCheckpoint,
    is_complete,
    read_extra,
    read_whole,
    remove_incomplete,
)
from sslkit.checkpointing.state import capture, capture_sharded, hook_states, restore
from sslkit.distributed import barrier, is_distributed, is_primary
from sslkit.errors import STORAGE_ERRNOS, UserError, storage_error
from sslkit.files import atomic_write

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "checkpoint_dir",
    "commit",
    "save_checkpoint",
    "upgrade_position",
]

logger = logging.getLogger("sslkit")

LATEST = "latest.txt"


class CheckpointError(UserError):
    """No checkpoint of the run folder can be read; the message says how to start afresh."""

_NAME = re.compile(r"^checkpoint_(\d+)(\.pt)?$")


def checkpoint_dir(output_dir: str) -> str:
    """The folder that holds the checkpoints of the run in ``output_dir``."""
    return os.path.join(output_dir, "checkpoints")


def _complete(ckpt_dir: str, name: str) -> bool:
    """True for a checkpoint file, and for a sharded checkpoint folder whose save finished (``.metadata``)."""
    path = os.path.join(ckpt_dir, name)
    return is_complete(path) if name and not name.endswith(".pt") else bool(name) and g_pathmgr.exists(path)


def _list(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, name) of every complete checkpoint in ``ckpt_dir`` (files and sharded folders), oldest first.
    A folder whose save never finished is not one."""
    if not g_pathmgr.exists(ckpt_dir):
        return []
    found = [(int(m.group(1)), n) for n in g_pathmgr.ls(ckpt_dir) if (m := _NAME.match(n)) and _complete(ckpt_dir, n)]
    return sorted(found)


def commit(ckpt_dir: str, name: str, keep_last: int) -> None:
    """Point ``latest.txt`` at the complete checkpoint ``name`` (a file or folder), then delete the checkpoints
    beyond the ``keep_last`` newest (0 keeps all) and folders whose save never finished (older than ``name``)."""
    atomic_write(os.path.join(ckpt_dir, LATEST), lambda f: f.write(name.encode()))
    if keep_last > 0:
        for _, old in _list(ckpt_dir)[:-keep_last]:
            if old != name:
                _remove(os.path.join(ckpt_dir, old))
    mine = int(_NAME.match(name).group(1))  # type: ignore[union-attr]
    remove_incomplete(os.path.join(ckpt_dir, n) for n in os.listdir(ckpt_dir)
                      if (m := _NAME.match(n)) and not n.endswith(".pt") and int(m.group(1)) < mine)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def save_checkpoint(state: dict[str, Any], ckpt_dir: str, step: int, keep_last: int = 3) -> str:
    """Save ``state`` as ``checkpoint_<step>.pt`` atomically, then point ``latest.txt`` at it.

    The pointer is written last, so a crash at any moment leaves the previous checkpoint and
    pointer intact. Checkpoints beyond the ``keep_last`` newest are deleted (0 keeps all).
    """
    name = f"checkpoint_{step:09d}.pt"
    path = os.path.join(ckpt_dir, name)
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        atomic_write(path, lambda f: torch.save(state, f))
        commit(ckpt_dir, name, keep_last)
    except (OSError, RuntimeError) as exc:
        # torch.save reports a full disk as a RuntimeError ("enforce fail at inline_container.cc")
        # with the OSError as its cause, or none at all: look for the errno in the chain.
        cause = os_error_in(exc)
        if cause is None:
            raise
        with contextlib.suppress(OSError):  # the new file is incomplete or unpointed: keep the old pointer valid
            if _latest_file(ckpt_dir) != path and os.path.exists(path):
                os.remove(path)
        raise storage_error(cause, "the checkpoint", path, _latest_file(ckpt_dir)) from exc
    return path


def os_error_in(exc: BaseException) -> OSError | None:
    """The storage OSError behind ``exc`` (itself, a cause in its chain, or one named in torch's message)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in STORAGE_ERRNOS:
            return seen
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    for code, words in ((errno.ENOSPC, "No space left"), (errno.EDQUOT, "quota exceeded"),
                        (errno.EROFS, "Read-only file system"), (errno.EACCES, "Permission denied"),
                        (errno.EIO, "file write failed")):
        if words.lower() in text.lower():
            return OSError(code, os.strerror(code))
    return None


def _latest_file(ckpt_dir: str) -> str | None:
    """Path of the newest complete checkpoint: the one ``latest.txt`` names, or a newer complete one (a sharded
    folder written in the background whose run stopped before it could name it). None if there is none."""
    pointer = os.path.join(ckpt_dir, LATEST)
    named: tuple[int, str] | None = None
    if g_pathmgr.exists(pointer):
        with g_pathmgr.open(pointer, "r") as f:
            name = f.read().strip()
        if (m := _NAME.match(name)) and _complete(ckpt_dir, name):
            named = (int(m.group(1)), name)
    found = _list(ckpt_dir)
    newest = found[-1] if found else None
    if named is None or (newest is not None and newest[0] > named[0]):
        named = newest
    return os.path.join(ckpt_dir, named[1]) if named else None


def _read_file(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read one checkpoint file without running code: ``torch.load(weights_only=True)`` takes tensors, numbers,
    strings and plain containers only. A file that holds anything
    else (a pickled object whose loading would call a function) raises :class:`CheckpointError` naming it.
    A sharded checkpoint folder is read whole onto the CPU, without its optimizer state
    (:func:`sslkit.checkpointing.sharded.read_whole`): what evaluation and export need."""
    if os.path.isdir(path):
        return read_whole(path)
    with g_pathmgr.open(path, "rb") as f:
        try:
            return torch.load(f, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL (\S+)", str(exc))
            if found is None:
                raise  # not a refused object: a damaged file, which the caller treats as such
            raise CheckpointError(
                f"checkpoint {path} holds {found.group(1)}, which loading would call: sslkit loads only tensors and "
                "plain data (torch.load(weights_only=True)), so it refuses this file. A checkpoint sslkit wrote never "
                "holds one: if you did not make this file yourself, do not load it."
            ) from None


def upgrade_position(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its position under today's names: ``position.update`` (before every counter took "step",
    docs/configs.md, Renamed keys) as ``position.step``. What the tools read of an older run (its model, config and
    step); in place, and returned."""
    position = state.get("position") if isinstance(state, dict) else None
    if isinstance(position, dict) and "step" not in position and "update" in position:
        position["step"] = position.pop("update")
    return state


class Checkpointer:
    """A run's checkpoints, both ways.

    Writing: one file gathered by rank 0, or (``sharded``) a folder every rank writes its part of
    (:mod:`sslkit.checkpointing.sharded`), in the background with ``async_save``; a checkpoint becomes the latest
    (``latest.txt``) only once complete, the last ``keep_last`` are kept, a full disk becomes a
    :class:`~sslkit.errors.StorageError`, and a halted run's state goes to ``crash_<step>.pt``. When to save is the
    caller's (:class:`~sslkit.hooks.checkpoint.CheckpointHook`).

    Reading: :meth:`find` resolves what a user names (a run folder, its ``checkpoints/``, a file, a sharded folder),
    :meth:`latest` the newest committed checkpoint, :meth:`read` one without running code (tensors and plain data
    only; a sharded folder through its allow-list), :meth:`read_latest` falls back past a damaged one, and
    :meth:`resume` puts the state back into a task (:mod:`sslkit.checkpointing.state`: model, loss, optimizer
    resharded to this run's processes, hooks, position, every rank's RNG).
    """

    def __init__(self, output_dir: str, keep_last: int = 3, sharded: bool = False, async_save: bool = False) -> None:
        self.dir = checkpoint_dir(output_dir)
        self.keep_last = keep_last
        self.sharded = sharded
        self.async_save = async_save and sharded
        self._pending: tuple[Any, str] | None = None  # an async save in flight: its future and folder name
        self._async_group: Any = None

    # ------------------------------------------------------------------------------------------- reading
    def latest(self) -> str | None:
        """The checkpoint a resume would read (:func:`_latest_file`)."""
        return _latest_file(self.dir)

    @staticmethod
    def read(path: str) -> dict[str, Any]:
        """One checkpoint file or sharded folder, whole on the CPU, without running code (:func:`_read_file`), as
        today's format names it (:func:`upgrade_position`: a run from before the counters' rename is read too)."""
        return upgrade_position(_read_file(path, map_location="cpu"))

    def read_latest(self) -> tuple[dict[str, Any], str] | None:
        """The latest readable checkpoint of the run: ``(state, path)``, or None if there is none. A latest one that
        cannot be read (truncated, corrupt) is reported and the next older one is tried; one that would run code
        stops it. A sharded folder gives its shared state and its path under ``sharded``: each rank reads its own
        part of the model and optimizer when the state is restored."""
        latest = self.latest()
        if latest is None:
            return None
        candidates = [latest] + [os.path.join(self.dir, n) for _, n in reversed(_list(self.dir))
                                 if os.path.join(self.dir, n) != latest]
        for path in candidates:
            try:
                if os.path.isdir(path):
                    return {**read_extra(path), "sharded": path}, path
                return _read_file(path, map_location="cpu"), path
            except (CheckpointError, RefusedCheckpoint):
                raise  # not a damaged file: one that would run code
            except Exception as exc:  # a truncated or corrupt file: fall back to an older one
                logger.error("checkpoint %s is unreadable (%s: %s); trying an older one", path,
                             type(exc).__name__, exc)
        raise CheckpointError(
            f"no checkpoint in {self.dir} can be read ({len(candidates)} tried; the reasons are logged above). "
            "To start afresh in the same folder, run the same command with checkpoint.auto_resume=false: the old "
            "run's files are moved to previous/ in the folder, not deleted. Or set a new output_dir."
        )

    def resume(self, task: SSLTask) -> str | None:
        """Put the run's latest readable checkpoint back into ``task`` (:meth:`read_latest`, then :meth:`restore`);
        its path, or None when the run has none. Every rank calls it."""
        found = self.read_latest()
        if found is None:
            return None
        state, path = found
        self.restore(task, state)
        return path

    @staticmethod
    def restore(task: SSLTask, state: dict[str, Any]) -> None:
        """Put a state read by this checkpointer (or :meth:`state`'s) back into ``task``
        (:func:`sslkit.checkpointing.state.restore`)."""
        restore(task, state)

    @staticmethod
    def state(task: SSLTask, gather_rng: bool = True) -> dict[str, Any]:
        """``task``'s whole state as a checkpoint file holds it (:func:`sslkit.checkpointing.state.capture`; every
        rank calls it at the same point unless ``gather_rng=False``)."""
        return capture(task, gather_rng)

    @staticmethod
    def hook_states(task: SSLTask) -> dict[str, Any]:
        """The state of every named hook of ``task``, by name (a checkpoint's ``hooks``)."""
        return hook_states(task)

    @staticmethod
    def find(spec: str) -> tuple[str, str]:
        """``checkpoint=`` as a user gives it: a checkpoint file, a sharded checkpoint folder, a run folder (its
        latest checkpoint) or its ``checkpoints/`` folder. Returns ``(checkpoint, run folder)``; the run folder of a
        checkpoint is the folder above its ``checkpoints/`` (or the checkpoint's own folder). Raises
        :class:`CheckpointError` saying what was found instead."""
        if not spec:
            raise CheckpointError("no checkpoint given: add checkpoint=RUN_DIR (a run's output_dir: its latest "
                                  "checkpoint is used) or checkpoint=FILE.pt")
        path = os.path.expanduser(spec)
        if os.path.isdir(path) and os.path.exists(os.path.join(path, METADATA)):
            pass  # a sharded checkpoint folder itself: as a file
        elif os.path.isdir(path) and os.path.basename(os.path.normpath(path)).startswith("checkpoint_"):
            raise CheckpointError(f"checkpoint={spec}: this sharded checkpoint folder has no {METADATA}: its save "
                                  "never finished, so it is not loaded. Give the run folder (its newest complete "
                                  "checkpoint is used) or an older checkpoint.")
        elif os.path.isdir(path):
            return _in_folder(spec, path)
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint={spec}: no such file or folder. Give a run's output_dir (e.g. "
                                  "runs/simclr-fashion_mnist) or a checkpoint file inside its checkpoints/ folder.")
        parent = os.path.dirname(os.path.abspath(path))
        run_dir = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent
        return path, run_dir

    # ------------------------------------------------------------------------------------------- writing
    def save(self, source: SSLTask, why: str, wait: bool = True) -> tuple[str | None, dict[str, Any]]:
        """Write ``source``'s state now. Every rank calls it at the same point; a barrier keeps any rank from moving
        on (or exiting) before the file is complete. Sharded, ``wait=False`` with ``async_save`` returns once the
        state is copied, and the folder completes later (:meth:`finish_pending`). Returns the path on rank 0 (None
        elsewhere) and the hook states saved."""
        if self.sharded:
            return self._save_sharded(source, why, wait)
        state = capture(source)
        path = None
        if is_primary():
            path = save_checkpoint(state, self.dir, source.clock.step, self.keep_last)
            logger.info("saved checkpoint %s (%s)", path, why)
        barrier()
        return path, state["hooks"]

    def _save_sharded(self, source: SSLTask, why: str, wait: bool) -> tuple[str | None, dict[str, Any]]:
        self.finish_pending()
        model_state, optimizer_state, extra, own = capture_sharded(source)
        name = f"checkpoint_{source.clock.step:09d}"
        final = os.path.join(self.dir, name)
        rewrite = is_complete(final)  # the end of the run updating its last epoch's folder
        path = f"{final}.update" if rewrite else final
        if is_primary():
            os.makedirs(self.dir, exist_ok=True)
            if os.path.isdir(path):  # a save of this step that never finished
                shutil.rmtree(path)
        barrier()
        use_async = self.async_save and not wait and not rewrite
        if use_async and is_distributed() and self._async_group is None:
            import torch.distributed as dist  # its own group: its collectives run beside the training's

            self._async_group = dist.new_group(backend="gloo")
        try:
            future = sharded_checkpoint.save(model_state, optimizer_state, extra if is_primary() else None, path,
                                             rank_state=(source.rank, own), async_save=use_async,
                                             process_group=self._async_group if use_async else None)
        except sharded_checkpoint.failures() as exc:
            self._raise_storage(exc, path)
            raise
        saved = final if is_primary() else None
        if future is not None:
            self._pending = (future, name)
            logger.info("writing checkpoint %s in the background (%s)", final, why)
            return saved, extra["hooks"]
        if rewrite and is_primary():
            os.replace(final, f"{final}.old")
            os.replace(path, final)
            shutil.rmtree(f"{final}.old")
        self._commit(name)
        if is_primary():
            logger.info("saved checkpoint %s (%s)", final, why)
        return saved, extra["hooks"]

    def _raise_storage(self, exc: BaseException, path: str) -> None:
        """A full disk (or another storage error) while writing ``path``, in the chain of ``exc`` or among a
        torch.distributed.checkpoint error's per-rank failures: raised as sslkit's StorageError."""
        causes = [exc, *getattr(exc, "failures", {}).values()]
        for cause in causes:
            found = os_error_in(cause) if isinstance(cause, BaseException) else None
            if found is not None:
                raise storage_error(found, "the checkpoint", path, _latest_file(self.dir)) from exc

    def _commit(self, name: str) -> None:
        """Rank 0 points latest.txt at the complete folder ``name`` and prunes old ones; then every rank goes on."""
        if is_primary():
            commit(self.dir, name, self.keep_last)
        barrier()

    def finish_pending(self) -> None:
        """Wait for the background save in flight, if any, and make it the latest checkpoint. Every rank calls it."""
        if self._pending is None:
            return
        future, name = self._pending
        self._pending = None
        try:
            future.result()
        except sharded_checkpoint.failures() as exc:
            self._raise_storage(exc, os.path.join(self.dir, name))
            raise
        self._commit(name)
        if is_primary():
            logger.info("saved checkpoint %s (written in the background)", os.path.join(self.dir, name))

    def write_crash(self, state: dict[str, Any], step: int, message: str) -> str:
        """The state of a halted run as ``crash_<step>.pt`` (rank 0, no collective), for inspection: never resumed
        from, and ``latest.txt`` keeps naming the last good checkpoint. Returns its path."""
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"crash_{step:09d}.pt")
        state["crash"] = message
        atomic_write(path, lambda f: torch.save(state, f))
        return path


def _in_folder(spec: str, path: str) -> tuple[str, str]:
    """:meth:`Checkpointer.find` of a folder that is not a checkpoint: a run folder or its ``checkpoints/``."""
    found = _latest_file(checkpoint_dir(path))
    run_dir = path
    if found is None:
        found = _latest_file(path)  # the checkpoints/ folder itself
        run_dir = os.path.dirname(os.path.abspath(path)) if found else path
    if found is None:
        raise CheckpointError(f"checkpoint={spec}: the folder holds no checkpoint (no {checkpoint_dir(path)}/"
                              "checkpoint_*.pt). Give a run's output_dir after at least one checkpoint was written, "
                              "or a checkpoint file.")
    return found, run_dir
