"""What a run's checkpoint holds and how it goes back into the run: every stateful part of a task (model, loss,
optimizer, scaler, hooks, position, the update guard, each rank's RNG and rank-local buffers), whole or sharded.
Only :class:`~sslkit.checkpoint.Checkpointer` calls it: the task is plain state, and the checkpointer owns its
serialisation both ways."""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sslkit.checkpointing.sharded import load_into, read_rank_state
from sslkit.distributed import all_gather_object
from sslkit.parallel import (
    full_model_state,
    full_optimizer_state,
    is_sharded,
    load_full_model_state,
    load_optimizer_state,
)

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["capture", "capture_sharded", "hook_states", "restore", "rng_state", "set_rng_state"]

logger = logging.getLogger("sslkit")


def capture(task: SSLTask, gather_rng: bool = True) -> dict[str, Any]:
    """Everything needed to continue ``task``'s run exactly: model, loss, optimizer, scaler, hooks, position and the
    RNG states of every rank.

    In a distributed run every rank must call it at the same point (the RNG states are gathered, and an FSDP2 model
    is gathered whole onto rank 0); rank 0 then writes the result. ``gather_rng=False`` (error paths) keeps only
    this rank's RNG state and runs no collective but FSDP2's gather.
    """
    if is_sharded(task.model):
        model_state = full_model_state(task.model)
        optimizer_state = full_optimizer_state(task.model, task.optimizer)
    else:
        model_state, optimizer_state = task.base_model.state_dict(), task.optimizer.state_dict()
    return {"model": model_state, "optimizer": optimizer_state, **_run_state(task, gather_rng)}


def capture_sharded(task: SSLTask) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """What a sharded checkpoint holds (:mod:`sslkit.checkpointing.sharded`): this rank's model and optimizer state
    dicts as torch.distributed.checkpoint reads them (DTensor shards under FSDP2, parameters by name), the rest of
    :func:`capture` that is the same on every rank, and this rank's own state (its RNG states and rank-local
    buffers), which it writes under a key of its own: nothing is gathered. Every rank calls it at the same point."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_state = get_model_state_dict(task.model)
    optimizer_state = get_optimizer_state_dict(task.model, task.optimizer)
    shared = _run_state(task, gather_rng=False)
    own = {"rng": shared.pop("rng")[0], "rank_local": shared.pop("rank_local")[0]}
    return model_state, optimizer_state, shared, own


def _run_state(task: SSLTask, gather_rng: bool) -> dict[str, Any]:
    """:func:`capture` but the model and the optimizer. A phase whose data ran out is saved as the start of the
    next one."""
    phase_idx, steps = (task.phase_idx + 1, 0) if task.phase_done else (task.phase_idx, task.clock.step_in_epoch)
    return {
        "loss": task.loss.state_dict(),
        "scaler": task.scaler.state_dict() if task.scaler is not None else None,
        "hooks": hook_states(task),
        "position": {
            "phase_idx": phase_idx,
            "step_in_epoch": steps,
            "step": task.clock.step,
            "samples": task.clock.samples,
            "stage": task.clock.stage,
            **task.guard.state_dict(),
        },
        "rng": all_gather_object(rng_state()) if gather_rng else [rng_state()],  # one entry per rank
        "rank_local": _rank_local_state(task, gather_rng),
        # the resolved config as YAML text (plain data: weights_only loading reads it), so a checkpoint file copied
        # out of its run folder still says how to rebuild its model (sslkit knn/linear/export)
        "config": task.config_text,
    }


def hook_states(task: SSLTask) -> dict[str, Any]:
    """The state of every named hook, by name (what a checkpoint stores under ``hooks``)."""
    return {h.name: h.state_dict() for h in task.hooks if h.name}


def _rank_local_buffers(task: SSLTask) -> dict[str, torch.Tensor]:
    """The buffers that hold different values on different ranks, by ``part.module.buffer`` name: those a module
    lists in its ``rank_local_state`` (e.g. SwAV's per-process queue). Everything else in the model and the loss is
    identical on every rank (DDP broadcasts buffers; queues of gathered keys and all-reduced centres are the same
    everywhere)."""
    found: dict[str, torch.Tensor] = {}
    for part, root in (("model", task.base_model), ("loss", task.loss)):
        for prefix, module in root.named_modules():
            for name in getattr(module, "rank_local_state", ()):
                found[".".join(x for x in (part, prefix, name) if x)] = getattr(module, name)
    return found


def _rank_local_state(task: SSLTask, gather: bool) -> list[dict[str, torch.Tensor]]:
    local = {k: v.detach().cpu().clone() for k, v in _rank_local_buffers(task).items()}
    return all_gather_object(local) if gather and local else [local]


def restore(task: SSLTask, state: dict[str, Any]) -> None:
    """Put what :func:`capture` returned back into ``task``, or a sharded checkpoint's shared state with its
    ``sharded`` folder (each rank then reads its part of the model and optimizer, resharded to this run's
    processes). Model, loss and optimizer state go onto the device of the tensors they are copied into; the RNG
    states (CPU tensors) are this rank's, or the same rank's of a run of another size with a warning."""
    if "sharded" in state:
        load_into(state["sharded"], task.model, task.optimizer, task.base_model)
        saved_world, own = read_rank_state(state["sharded"], task.rank)
        state = {**state, "rng": [own["rng"]] * saved_world, "rank_local": [own["rank_local"]] * saved_world}
    else:
        if is_sharded(task.model):  # every rank read the whole state; each keeps its shards
            load_full_model_state(task.model, state["model"])
        else:
            task.base_model.load_state_dict(state["model"])
        load_optimizer_state(task.base_model, task.optimizer, state["optimizer"])  # numbered or named
    task.loss.load_state_dict(state["loss"])
    if task.scaler is not None and state["scaler"] is not None:
        task.scaler.load_state_dict(state["scaler"])
    saved_hooks = state["hooks"]
    for hook in task.hooks:
        if hook.name and hook.name in saved_hooks:
            hook.load_state_dict(saved_hooks[hook.name])
    _restore_position(task, state["position"])
    rng = state["rng"]
    if len(rng) != task.world_size:
        logger.warning(
            "the checkpoint holds the RNG states of %d process(es) and this run has %d: training continues, but not "
            "bit-identically to an uninterrupted run", len(rng), task.world_size)
    set_rng_state(rng[task.rank % len(rng)])
    rank_local = state["rank_local"] or [{}]
    mine = rank_local[task.rank % len(rank_local)]
    with torch.no_grad():
        for key, buffer in _rank_local_buffers(task).items():
            if key in mine:
                buffer.copy_(mine[key].to(buffer.device))


def _restore_position(task: SSLTask, pos: dict[str, Any]) -> None:
    task.phase_idx = pos["phase_idx"]
    task.clock.step_in_epoch = pos["step_in_epoch"]
    task.clock.step = pos["step"]
    task.clock.samples = pos["samples"]
    task.clock.stage = pos["stage"]
    task.guard.load_state_dict(pos)


def rng_state() -> dict[str, Any]:
    """The RNG states of python, numpy, torch (CPU) and CUDA on this process, as plain containers, numbers and
    tensors only, so that a checkpoint loads with ``torch.load(weights_only=True)`` (no pickled numpy array)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s output."""
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]  # the key array is stored as a tensor (a checkpoint holds no numpy object)
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
