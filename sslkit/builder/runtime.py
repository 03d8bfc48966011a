"""The process's side of a run, set before anything is built: device, determinism, threads, seed, loader workers."""

from __future__ import annotations

import os
import random

import numpy as np
import torch
from omegaconf import DictConfig

from sslkit.distributed import get_rank, get_world_size, setup_control_group

__all__ = ["resolve_device", "resolve_num_workers", "seed_everything", "set_determinism", "setup_runtime"]


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cuda`` on a machine without one is an error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("machine.device=cuda but no CUDA device is visible; use machine.device=cpu or auto")
        if name == "cuda":
            name = f"cuda:{torch.cuda.current_device()}"
        torch.cuda.set_device(name)  # so that events, streams and caches default to this GPU too
    return torch.device(name)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_determinism(deterministic: bool, device: torch.device) -> None:
    """``machine.deterministic``: everything PyTorch needs for run-to-run identical results on CUDA.

    On: ``torch.use_deterministic_algorithms(True)`` (deterministic kernels, and an error naming
    any operation that has none), cuDNN in deterministic mode without autotuning, and
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which cuBLAS reads when its first handle is made (so
    :func:`build_task` calls this before anything computes on the device; a value the user
    exported is kept). Off: cuDNN autotunes its convolution
    algorithms on CUDA (``cudnn.benchmark``), the fastest choice for the fixed crop sizes of SSL.
    Data order and augmentations are deterministic either way (seeded by seed, epoch, index).
    """
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if deterministic or torch.are_deterministic_algorithms_enabled():  # (off by default: the call imports inductor)
        torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = device.type == "cuda" and not deterministic


def _cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a SLURM allocation), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_num_workers(setting: int | str, device: torch.device) -> tuple[int, str]:
    """``data.num_workers``: the number itself, or for ``auto`` one derived from the cores per process.

    The cores (affinity mask) are shared by the processes of this machine (``LOCAL_WORLD_SIZE``).
    On CUDA the model runs on the GPU and the training process needs one core to feed it, so the
    workers take the rest: ``cores - 1`` (15 on a 16-core, 1-GPU machine). On the CPU the model
    itself computes on those cores, so the workers take half. Returns the number and how it was
    chosen, for the log.
    """
    if setting != "auto":
        return int(setting), "data.num_workers"
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    cores = max(1, _cores() // local)
    share = f"{cores} core(s) per process ({_cores()} for {local} process(es))"
    if device.type == "cuda":
        return max(1, cores - 1), f"auto: {share}, one kept for the training process"
    return max(1, cores // 2), f"auto: {share}, half of them for the model on the CPU"



def setup_runtime(cfg: DictConfig) -> tuple[torch.device, int, int]:
    """Before anything is built: the device, determinism (before anything computes on it), the CPU threads, the
    seed (``seed`` plus the rank) and the control group (every rank, before any other group is created). Returns
    ``(device, rank, world size)``."""
    rank, world = get_rank(), get_world_size()
    device = resolve_device(cfg.machine.device)
    set_determinism(cfg.machine.deterministic, device)
    if cfg.machine.num_threads > 0:
        torch.set_num_threads(cfg.machine.num_threads)
    seed_everything(cfg.seed + rank)
    setup_control_group()
    return device, rank, world
