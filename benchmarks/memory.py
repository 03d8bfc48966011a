"""Bytes each process holds for parameters, gradients, optimizer state and saved activations, ddp against fsdp.

    python benchmarks/memory.py [--nproc 2] [--strategies ddp,fsdp] [key=value ...]

For each strategy, with and without ``model.activation_checkpointing``, ``--nproc`` gloo processes on the CPU
build the recipe (``config=NAME`` and any overrides; the default is ``config=dinov2`` as it trains on
Fashion-MNIST) and run one optimizer step of sslkit's standard step. Each process then counts, on its own:

* **parameters**: every parameter it holds (its shard under fsdp: ``DTensor.to_local()``), teachers included;
* **gradients**: every ``.grad`` after the step (sharded likewise);
* **optimizer state**: every tensor of ``optimizer.state`` (AdamW's two moments: sharded likewise);
* **activations**: the bytes autograd saved for backward during that step's forward and loss, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (parameters left out: FSDP gathers and frees those itself).
  Under activation checkpointing only each block's input is kept; the rest is recomputed in backward.

These are tensor sizes, not an allocator's peak: the same figures on any device. The table gives rank 0's
numbers and the ratio of each to ddp without checkpointing: fsdp should hold about 1/N of the parameters,
gradients and optimizer state (N processes; the blocks' shards are padded to a multiple of N rows), the same
activations, and checkpointing a fraction of them. A GPU's peak memory adds the all-gathered block in flight
(fsdp), the allocator's cache and the workspace of its kernels: measure that with ``torch.cuda.max_memory_allocated``
on the GPU (``benchmarks/throughput.py --strategy fsdp``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["main", "measure"]

#: Overrides of every run: one step on the CPU, nothing but training.
FIXED = ["machine.device=cpu", "optim.max_steps=1", "eval.knn.enabled=false", "log.tensorboard=false",
         "log.report=false", "checkpoint.every_n_epochs=0", "checkpoint.every_n_steps=0", "data.num_workers=0"]


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def measure(rank: int, world: int, overrides: Sequence[str], out: str) -> dict[str, int]:
    """One process's bytes (see the module docstring) after one step of ``overrides``' run on ``world`` gloo
    processes; call it on every rank of an initialised group."""
    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config
    from sslkit.train_steps.standard import standard_train_step
    from sslkit.trainer import train

    cfg = compose_config([*overrides, *FIXED, f"output_dir={out}"])
    os.makedirs(cfg.output_dir, exist_ok=True)
    task = build_task(cfg)
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_leaf and t.requires_grad):  # parameters: FSDP gathers and frees them itself
            saved[0] += _local_bytes(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            train(task, standard_train_step)
    finally:
        task.close()
    params = list(task.model.parameters())
    state = [v for s in task.optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]  # AdamW's 0-d step counters left out
    return {"parameters": sum(_local_bytes(p) for p in params),
            "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(_local_bytes(v) for v in state),
            "activations": saved[0]}


def _entry(rank: int, world: int, port: int, runs: list[list[str]], out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = [measure(rank, world, overrides, f"{out}/run{i}") for i, overrides in enumerate(runs)]
        torch.save(result, f"{out}/bytes.{rank}")
    finally:
        dist.destroy_process_group()


def run(runs: Sequence[Sequence[str]], nproc: int) -> list[list[dict[str, int]]]:
    """``measure`` of each run's overrides, one after the other on the same ``nproc`` fresh gloo processes: for
    each run, each rank's bytes."""
    from sslkit.distributed import find_free_port

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(nproc, find_free_port(), [list(r) for r in runs], out), nprocs=nproc,
                           join=True, start_method="spawn")
        per_rank = [torch.load(f"{out}/bytes.{r}") for r in range(nproc)]
    return [[per_rank[r][i] for r in range(nproc)] for i in range(len(runs))]


def _mib(n: int) -> str:
    return f"{n / 2**20:9.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table (see the module docstring); exit 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategies", default="ddp,fsdp")
    args, overrides = parser.parse_known_args(argv)
    if not any(o.startswith("config=") for o in overrides):
        overrides = ["config=dinov2", *overrides]
    names, runs = [], []
    for ac in (False, True):
        for strategy in args.strategies.split(","):
            names.append(f"{strategy}{' + checkpointing' if ac else ''}")
            runs.append([*overrides, f"distributed.strategy={strategy}",
                         f"model.activation_checkpointing={str(ac).lower()}"])
    rows = [(name, got[0]) for name, got in zip(names, run(runs, args.nproc), strict=True)]
    print(f"{' '.join(overrides)}; {args.nproc} gloo processes on the CPU, torch {torch.__version__}; "
          "MiB held by rank 0 after one step (ratio to the first row)")
    keys = ["parameters", "gradients", "optimizer", "activations"]
    print(f"{'':26s}" + "".join(f"{k:>22s}" for k in keys))
    base = rows[0][1]
    for name, got in rows:
        print(f"{name:26s}" + "".join(f"{_mib(got[k])} MiB ({got[k] / max(base[k], 1):5.2f})" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
