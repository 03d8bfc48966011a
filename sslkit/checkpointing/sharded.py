"""Sharded checkpoints: torch.distributed.checkpoint folders that every rank writes its part of, read into any layout.

A sharded checkpoint is a folder ``checkpoint_<step>/`` beside the single-file ones. In it, each rank's
``__<rank>_0.distcp`` holds its shards of the model and the optimizer (each parameter written once, by the rank
that holds it), and ``.metadata`` says where every piece lies. ``.metadata`` is written last, by rank 0 once every
rank's files are complete (torch writes it to a temporary name and renames it): a folder without it is a save
that never finished, and sslkit never loads one. What is the same on every rank (hooks, position, loss, scaler, the
config) is one ``extra`` item in rank 0's file; each rank's own state (its RNG states, its rank-local buffers such as
SwAV's queue) is an item ``rank_state.<rank>`` in its own file. Nothing is gathered.

Loading reshards: the same folder loads into an FSDP2 run on any number of processes, a DDP run or one process
(:func:`load_into`), and into a plain state dict with no process group for evaluation and export
(:func:`read_whole`). Reading runs no code from the folder: ``.metadata`` is unpickled with an allow-list of
torch's checkpoint record classes, and ``extra`` with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import logging
import os
import pickle
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from sslkit.errors import UserError

__all__ = ["METADATA", "RefusedCheckpoint", "ShardedCheckpointError", "failures", "is_complete", "load_into",
           "read_extra", "read_whole", "remove_incomplete", "save"]

logger = logging.getLogger("sslkit")


def failures() -> tuple[type[BaseException], ...]:
    """What a failed save or load raises: torch.distributed.checkpoint's CheckpointException (a BaseException, which
    holds each rank's error in ``failures``) and ordinary errors. A function, for ``except failures():`` (evaluated
    when an error is on its way): torch.distributed.checkpoint's import takes about a second (DTensor), so it is
    imported only by the runs that write or read sharded checkpoints."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


#: The file torch.distributed.checkpoint writes last: a folder holds a complete checkpoint only once it exists.
METADATA = ".metadata"


class ShardedCheckpointError(UserError):
    """A sharded checkpoint folder cannot be read (a missing shard file, a refused record); the message says
    which file and what to do."""


class RefusedCheckpoint(ShardedCheckpointError):
    """A sharded checkpoint folder whose ``.metadata`` names code that loading would call: never a damaged save
    to fall back from, a file not to load."""


def is_complete(path: str) -> bool:
    """True when ``path`` is a sharded checkpoint folder whose save finished (its ``.metadata`` exists)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))


# ------------------------------------------------------------------------------------------------ safe reading
#: What ``.metadata`` may name when unpickled: torch's plain checkpoint records, sizes, dtypes and paths.
_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}
_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
            ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _RecordUnpickler(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint's ``.metadata`` and nothing that would call other code."""

    def find_class(self, module: str, name: str) -> Any:
        import importlib

        found = getattr(importlib.import_module(module), name, None) if module.split(".")[0] in (
            "torch", "pathlib", "collections") else None
        allowed = (module, name) in _ALLOWED or (module in _ALLOWED_MODULES and isinstance(found, type)) or (
            module == "torch" and isinstance(found, torch.dtype))
        if not allowed or found is None:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")
        return found


@functools.lru_cache(maxsize=4)
def _read_metadata(path: str, stamp: tuple[int, int]) -> Any:
    """``path``'s ``.metadata`` unpickled by :class:`_RecordUnpickler`, once per version of the file (``stamp``:
    its mtime and size): a resume reads it for the run's record, its own state and the model, and it grows with
    the number of tensors times the number of ranks."""
    with open(os.path.join(path, METADATA), "rb") as f:
        try:
            return _RecordUnpickler(f).load()
        except pickle.UnpicklingError as exc:
            raise RefusedCheckpoint(
                f"{os.path.join(path, METADATA)} holds {str(exc).removeprefix('GLOBAL ')}, which loading "
                "would call: sslkit reads only torch's checkpoint records there, so it refuses this folder. "
                "A checkpoint sslkit wrote never holds one: if you did not make this folder, do not load it."
            ) from None


def _metadata(path: str) -> Any:
    """The checkpoint folder ``path``'s records (``.metadata``), read safely, shared by every read of it."""
    info = os.stat(os.path.join(path, METADATA))
    return _read_metadata(path, (info.st_mtime_ns, info.st_size))


def _reader(path: str) -> Any:
    """A FileSystemReader of ``path`` whose ``.metadata`` is :func:`_metadata`'s."""
    import copy

    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = copy.copy(_metadata(path))  # this load's id on a copy: the shared records stay as read
            if getattr(metadata, "storage_meta", None) is not None:
                metadata.storage_meta = copy.copy(metadata.storage_meta)
                metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _planner(**kwargs: Any) -> Any:
    """A DefaultLoadPlanner that reads byte items with ``torch.load(weights_only=True)`` (torch's own runs any
    pickled code in them), onto the CPU as one-file checkpoints are read."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, map_location="cpu", weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafePlanner(**kwargs)


def _load(state: dict[str, Any], path: str, no_dist: bool, process_group: Any = None) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` from ``path``, safely, with a missing or damaged shard
    file said as :class:`ShardedCheckpointError`."""
    import torch.distributed.checkpoint as dcp

    _metadata(path)  # refused here, in sslkit's words (torch wraps a reader's errors in its own)
    try:
        with _quiet():
            dcp.load(state, storage_reader=_reader(path), planner=_planner(), no_dist=no_dist,
                     process_group=process_group)
    except ShardedCheckpointError:
        raise
    except failures() as exc:
        missing = sorted(f for f in _shard_files(path) if not os.path.isfile(os.path.join(path, f)))
        if missing:
            raise ShardedCheckpointError(
                f"the sharded checkpoint {path} is missing {', '.join(missing)} (each rank of the run that wrote it "
                "wrote one file; on several machines, each wrote its own into this folder on their shared disk). "
                "Copy the file(s) back into the folder and run again; or, to resume from the checkpoint before "
                f"it, move {path} out of the checkpoints folder (latest.txt then falls back to the newest complete "
                "one)."
            ) from None
        raise ShardedCheckpointError(
            f"the sharded checkpoint {path} cannot be read ({type(exc).__name__}: {_short(exc)}). To resume from "
            f"the checkpoint before it, move {path} out of the checkpoints folder and run again."
        ) from exc


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without torch's warning that a load with no process group assumes one process (what sslkit asks for)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1][:300] if text else ""


def _shard_files(path: str) -> set[str]:
    """The data files the checkpoint's metadata points into."""
    storage = getattr(_metadata(path), "storage_data", None) or {}
    return {getattr(info, "relative_path", "") for info in storage.values()} - {""}


# ------------------------------------------------------------------------------------------------ write
def save(model_state: dict[str, Any], optimizer_state: dict[str, Any], extra: dict[str, Any] | None, path: str,
         async_save: bool = False, process_group: Any = None, rank_state: tuple[int, dict[str, Any]] | None = None
         ) -> Any:
    """Write a sharded checkpoint folder ``path``: every rank calls it with its own (sharded) model and optimizer
    state dicts; ``extra`` (plain data and small tensors, the same on every rank) is written once, by rank 0
    (pass None on the others); ``rank_state`` (rank, its own state: RNG, rank-local buffers) under the key
    ``rank_state.<rank>``, by that rank alone. Returns None once the folder is complete, or with ``async_save`` a
    future that completes when it is: the state is copied to host memory before this returns, so training may go on and
    change it. ``process_group``: the group the save's collectives use (an async save needs its own, so that its
    collectives in the background never meet the training's)."""
    import torch.distributed.checkpoint as dcp

    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    if extra is not None:  # one item: torch's own save would make a file entry of every number in it
        state["extra"] = _bytes(extra)
    if rank_state is not None:
        state["rank_state"] = {str(rank_state[0]): _bytes(rank_state[1])}
    import torch.distributed as dist

    os.makedirs(path, exist_ok=True)
    writer = dcp.FileSystemWriter(path, sync_files=True)
    no_dist = not (dist.is_available() and dist.is_initialized())
    with _quiet():
        if async_save:
            return dcp.async_save(state, storage_writer=writer, process_group=process_group, no_dist=no_dist)
        dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    return None


def _bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------------ read
def _saved_ranks(path: str) -> list[int]:
    """The ranks whose own state the checkpoint holds (``rank_state.<rank>``), in order."""
    return sorted(int(k.split(".", 1)[1]) for k in _metadata(path).state_dict_metadata if k.startswith("rank_state."))


def read_rank_state(path: str, rank: int) -> tuple[int, dict[str, Any]]:
    """(number of processes that wrote the checkpoint, the own state of rank ``rank``, or of ``rank`` modulo that
    number when this run has more), read by this process alone."""
    ranks = _saved_ranks(path)
    if not ranks:
        raise ShardedCheckpointError(f"the sharded checkpoint {path} holds no process's own state (rank_state.*): "
                                     "it was not written by this version of sslkit")
    mine = str(ranks[rank % len(ranks)])
    state: dict[str, Any] = {"rank_state": {mine: io.BytesIO()}}
    _load(state, path, no_dist=True)
    return len(ranks), _unbytes(state["rank_state"][mine])


def _unbytes(data: bytes) -> Any:
    """An item :func:`_bytes` wrote, read without running code and onto the CPU (a GPU run's loss and hook states
    hold CUDA tensors: evaluation on a machine without one reads them too; a resume moves them where they go)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def read_extra(path: str) -> dict[str, Any]:
    """The non-tensor part of the task state in a complete sharded checkpoint (hooks, position, loss, scaler,
    config), read by this process alone (no collective)."""
    state: dict[str, Any] = {"extra": io.BytesIO()}
    _load(state, path, no_dist=True)
    return _unbytes(state["extra"])


def _template(path: str, prefix: str) -> dict[str, Any]:
    """Empty CPU tensors (and byte placeholders) for every item under ``prefix`` of the checkpoint, by its flat
    name: what a process loads the whole of them into."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat: dict[str, Any] = {}
    for name, meta in _metadata(path).state_dict_metadata.items():
        if name == prefix or name.startswith(prefix + "."):
            flat[name] = (torch.empty(meta.size, dtype=meta.properties.dtype)
                          if isinstance(meta, TensorStorageMetadata) else io.BytesIO())
    return flat


def read_whole(path: str, optimizer: bool = False) -> dict[str, Any]:
    """The model whole, with the rest of the task state, as a one-file checkpoint holds them (``model``, ``loss``,
    ``hooks``, ``position``, ``config``, ...): what evaluation and export read; with ``optimizer``, its state too
    (parameters by name, as ``torch.distributed.checkpoint.state_dict`` gives it). No process group is needed;
    each tensor is read in full onto the CPU."""
    import torch.distributed.checkpoint as dcp

    metadata = _metadata(path)
    flat = _template(path, "model")
    if optimizer:
        flat.update(_template(path, "optimizer"))
    planner = _planner(flatten_state_dict=False)
    try:
        with _quiet():
            dcp.load(flat, storage_reader=_reader(path), planner=planner, no_dist=True)
        flat.update(planner.state_dict)  # (the byte items land in the planner's copy of the dict)
    except ShardedCheckpointError:
        raise
    except failures():
        _load({"model": {}}, path, no_dist=True)  # says which file is missing
        raise
    state = read_extra(path)
    own = [read_rank_state(path, r)[1] for r in _saved_ranks(path)]
    state["rng"], state["rank_local"] = [o["rng"] for o in own], [o["rank_local"] for o in own]
    state["model"] = {name[len("model."):]: value for name, value in flat.items() if name.startswith("model.")}
    if optimizer:
        nested: dict[str, Any] = {}
        for name, value in flat.items():
            if name.startswith("optimizer."):
                _put(nested, metadata.planner_data[name], value)
        state["optimizer"] = nested["optimizer"]
    return state


def _put(root: dict[str, Any], keys: tuple[Any, ...], value: Any) -> None:
    """Set ``root[k0][k1]...`` = ``value``, making dicts (for string keys) and lists (for int keys) on the way."""
    node: Any = root
    for key, following in itertools.pairwise(keys):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = empty
        else:
            node.setdefault(key, empty)
        node = node[key]
    if isinstance(node, list):
        while len(node) <= keys[-1]:
            node.append(None)
    node[keys[-1]] = value


def _optimizer_names_saved(path: str) -> set[str]:
    """The parameter names that have optimizer state in the checkpoint (a parameter that had no gradient yet has
    none)."""
    names = set()
    for name in _metadata(path).state_dict_metadata:
        if name.startswith("optimizer.state."):
            names.add(name[len("optimizer.state."):].rsplit(".", 1)[0])
    return names


def load_into(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, base_model: nn.Module | None = None,
              process_group: Any = None) -> None:
    """Load the model and optimizer of the sharded checkpoint ``path`` into ``model`` (sharded by FSDP2 on any
    number of ranks, wrapped in DDP, or whole; ``base_model``: what DDP wraps) and ``optimizer``: each rank reads
    the pieces it holds. Every rank of a process group calls it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from sslkit.parallel import drop_unsaved_optimizer_state, restore_tuples

    model_state = get_model_state_dict(model)
    saved = _optimizer_names_saved(path)
    tuples = [{k for k, v in group.items() if isinstance(v, tuple)} for group in optimizer.param_groups]
    optimizer_state = get_optimizer_state_dict(model, optimizer)  # (creates every parameter's state first)
    optimizer_state["state"] = {k: v for k, v in optimizer_state["state"].items() if k in saved}
    no_dist = not (dist.is_available() and dist.is_initialized())
    _load({"model": model_state, "optimizer": optimizer_state}, path, no_dist=no_dist, process_group=process_group)
    set_model_state_dict(model, model_state)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=StateDictOptions(strict=False))
    restore_tuples(optimizer, tuples)
    drop_unsaved_optimizer_state(base_model or model, optimizer, saved)


def remove_incomplete(folders: Iterable[str]) -> None:
    """Delete sharded checkpoint folders whose save never finished (no ``.metadata``)."""
    import shutil

    for folder in folders:
        if os.path.isdir(folder) and not is_complete(folder):
            logger.info("removing %s: a sharded checkpoint whose save never finished", folder)
            shutil.rmtree(folder, ignore_errors=True)
