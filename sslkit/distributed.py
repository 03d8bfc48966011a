"""The one place sslkit touches torch.distributed: rank helpers, reductions and gathers."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ParentFd",
    "agree_any",
    "all_gather_object",
    "all_reduce_max",
    "all_reduce_mean",
    "all_reduce_sum",
    "all_reduce_sum_with_grad",
    "barrier",
    "gather_no_grad",
    "gather_with_grad",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "is_primary",
]


def is_distributed() -> bool:
    """True when a process group of more than one process is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_primary() -> bool:
    """True on the process that writes logs, metrics and checkpoints (rank 0)."""
    return get_rank() == 0


def barrier() -> None:
    """Wait for every process; a no-op without a process group."""
    if is_distributed():
        dist.barrier()


_CONTROL_GROUP: Any = None


def setup_control_group() -> None:
    """Create the CPU (gloo) group that :func:`agree_any` uses; call it on every rank, in the same
    order as other group creations (:func:`sslkit.builder.build_task` does). A group of its own
    keeps control messages from ever pairing with a collective of the training (and, under nccl,
    off the GPU streams)."""
    global _CONTROL_GROUP
    if not is_distributed() or _CONTROL_GROUP is not None:
        return
    _CONTROL_GROUP = dist.new_group(backend="gloo")


def agree_any(*flags: bool) -> list[bool]:
    """For each flag, True if it is True on any rank: one small all-reduce on the CPU (gloo).

    Every rank must call it at the same point with the same number of flags. It is how ranks
    agree to stop for a pre-emption signal or to skip a step after an out-of-memory error, so
    that no rank is left waiting in a collective the others never reach.
    """
    if not is_distributed():
        return [bool(f) for f in flags]
    setup_control_group()
    t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device="cpu")  # gloo group: CPU
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_CONTROL_GROUP)
    return [bool(v) for v in t.tolist()]


def all_gather_object(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` without a process group). Pickles through
    the CPU control group, so it works under nccl without touching the GPU."""
    if not is_distributed():
        return [obj]
    setup_control_group()
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj, group=_CONTROL_GROUP)
    return out


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of ``tensor`` over all processes (a new tensor; the input is not modified).

    One all-reduce on the default group, on the tensor's own device (nccl for CUDA tensors, gloo
    for CPU ones). Without a process group it returns ``tensor`` itself.
    """
    if not is_distributed():
        return tensor
    out = all_reduce_sum(tensor)
    world = get_world_size()
    return out.div_(world) if out.is_floating_point() or out.is_complex() else out / world  # ints: a float mean


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    """``op`` of ``tensor`` over all processes: one all-reduce on the default group, on the tensor's own device,
    into a new tensor; ``tensor`` itself without a process group."""
    if not is_distributed():
        return tensor
    out = tensor.clone()
    dist.all_reduce(out, op=op)
    return out


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over all processes (a new tensor; the input is not modified; ``tensor`` itself
    without a process group)."""
    return _all_reduce(tensor, dist.ReduceOp.SUM)


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum of ``tensor`` over all processes (a new tensor; the input is not modified;
    ``tensor`` itself without a process group)."""
    return _all_reduce(tensor, dist.ReduceOp.MAX)


def all_reduce_sum_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over all processes (a new tensor) whose backward sums the gradient over ranks.

    Differentiable counterpart of :func:`all_reduce_sum` (what the synced BatchNorm reduces its
    statistics with): the gradient reaching this rank's input is the derivative of the sum of every
    rank's loss. Every rank must run the backward through it, as for any collective. Without a
    process group it returns ``tensor`` itself.
    """
    if not is_distributed():
        return tensor
    from torch.distributed.nn.functional import all_reduce  # its backward all-reduces the gradient with the same op

    return all_reduce(tensor, op=dist.ReduceOp.SUM)


class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward all-reduces the incoming gradient and returns this rank's slice.

    Every rank computes the loss on the gathered tensor, so the gradient with respect to this
    rank's input is the sum over ranks of each rank's gradient for that slice.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        world = dist.get_world_size()
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x.contiguous())
        ctx.batch = x.shape[0]
        return torch.cat(out, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        rank = dist.get_rank()
        return grad[rank * ctx.batch : (rank + 1) * ctx.batch]


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate ``x`` (dim 0, equal sizes) from every rank, keeping the gradient path.

    With one process it returns ``x`` itself.
    """
    if not is_distributed():
        return x
    return _GatherWithGrad.apply(x)


@torch.no_grad()
def gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate ``x`` (dim 0, equal sizes) from every rank, detached (e.g. MoCo keys)."""
    if not is_distributed():
        return x.detach()
    out = [torch.empty_like(x) for _ in range(get_world_size())]
    dist.all_gather(out, x.detach().contiguous())
    return torch.cat(out, dim=0)


logger = logging.getLogger("sslkit")


#: Signals the spawning parent passes on to its workers instead of dying of them (the pre-emption
#: signals). A signal sent to the whole process group reaches each worker twice (directly and passed
#: on); the workers take the second copy of a SIGINT that close for the same press.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher) set RANK and WORLD_SIZE for this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def find_free_port() -> int:
    """A TCP port on this machine that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_process_group(backend: str = "auto", timeout_s: float = 1800.0, device: str = "auto") -> torch.device:
    """Join the process group described by the environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT) and return this process's device.

    ``device`` is ``machine.device``: ``cpu`` keeps every process on the CPU even where GPUs are
    visible; ``auto``, ``cuda`` (or ``cuda:N``) give each process the GPU of its local rank,
    ``cuda:<LOCAL_RANK>``. ``backend`` ``auto`` is nccl for GPU processes and gloo for CPU ones.
    A collective that waits longer than ``timeout_s`` fails instead of hanging.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device != "cpu" and torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    where = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(where)
    else:  # CPU workers share the cores: one process's threads per core share, not all cores each
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=where if backend == "nccl" else None)
    return where


def _worker(local_rank: int, fn: Callable[..., Any], args: tuple[Any, ...], nproc: int, node_rank: int,
            world_size: int, master_addr: str, master_port: int, backend: str, timeout_s: float,
            device: str) -> None:
    os.environ.update({
        "RANK": str(node_rank * nproc + local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
    })
    init_process_group(backend, timeout_s, device)
    try:
        fn(*args)
    except Exception:
        # Printed here, before this process leaves the group: the parent re-raises only the error of
        # the first worker to exit, and that is often a peer that saw this one's sockets close
        # ("remote worker crashing"), not the cause. The cause is then always on stderr, first.
        sys.stderr.write(f"sslkit: worker of rank {os.environ['RANK']} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        raise
    finally:
        shutdown()


def shutdown() -> None:
    """Leave the process group, if this process is in one."""
    global _CONTROL_GROUP
    _CONTROL_GROUP = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


#: What the worker processes' fork server imports once, before it forks them: each worker then starts in
#: milliseconds instead of importing torch and sslkit anew (about 4 s of one core each on a small machine).
WORKER_PRELOAD = ("torch", "torchvision", "timm", "sslkit.builder", "sslkit.launch.cli")


class ParentFd:
    """The parent's file descriptor ``fd`` as a child of a fork server receives it (:func:`start_processes`): pickled
    while the process starts, it is sent over the fork server's socket (as multiprocessing sends a pipe's) and
    unpickles to the child's copy of it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing.reduction import DupFd

        return _detach_fd, (DupFd(self.fd),)


def _detach_fd(dup: Any) -> int:
    return dup.detach()


def _as_parent(index: int, state: bytes, stdout: int, stderr: int) -> Any:
    """Entry of a process of :func:`start_processes`: take on the parent's environment, working folder,
    ``sys.path``, stdout and stderr as they are now (a fork server's children inherit them as they were when it
    started, maybe several launches ago), then run the function it was given."""
    import pickle

    for mine, theirs in ((1, stdout), (2, stderr)):
        os.dup2(theirs, mine)
        os.close(theirs)
    env, cwd, path, payload = pickle.loads(state)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    fn, args = pickle.loads(payload)  # after sys.path: the function may live in a module only it names
    return fn(index, *args)


def start_processes(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, join: bool = True,
                    preload: tuple[str, ...] = WORKER_PRELOAD) -> Any:
    """``torch.multiprocessing.start_processes(fn, args, nprocs, join)`` by a fork server that imported
    ``preload`` (default :data:`WORKER_PRELOAD`: what a training process imports) once, when this process starts
    its first server; a check that needs only torch says so and saves the server torchvision's and timm's imports.
    Like ``spawn``, no process inherits threads, CUDA or a process group from this one; unlike it, a process does
    not import torch again. Each process sees this process's environment, working folder, ``sys.path``, stdout
    and stderr as they are at this call. ``fn`` and ``args`` must pickle, as for spawn."""
    import pickle

    import torch.multiprocessing as mp

    mp.set_forkserver_preload(list(preload))  # (no effect once this process's fork server runs)
    state = pickle.dumps((dict(os.environ), os.getcwd(), list(sys.path), pickle.dumps((fn, args))))
    for stream in (sys.stdout, sys.stderr):  # what is written before the processes write
        stream.flush()
    return mp.start_processes(_as_parent, args=(state, ParentFd(1), ParentFd(2)), nprocs=nprocs, join=join,
                              start_method="forkserver")


#: Seconds the other workers have, after one exits with an error, to exit by themselves before they are stopped:
#: the same user error reaches every rank, rank 0 says it, and a rank that got there first must not cut it off.
EXIT_GRACE_S = 10.0


def launch(fn: Callable[..., Any], args: tuple[Any, ...] = (), nproc_per_node: int = 1, num_nodes: int = 1,
           node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: int = 0, backend: str = "auto",
           timeout_s: float = 1800.0, device: str = "auto") -> None:
    """Run ``fn(*args)`` in ``nproc_per_node`` new processes of a process group (:func:`start_processes`).

    Multi-node: start the same command on every node with its ``node_rank`` and the same
    ``master_addr`` / ``master_port`` (port 0 picks a free one, single node only). If any worker
    raises, the others are terminated and the error is re-raised here (torch.multiprocessing
    ``ProcessRaisedException``), so a failure never leaves a hanging run. Each worker that raises prints
    its traceback to stderr first, since the re-raised error may be a peer's echo of it. ``backend`` and ``device``
    as in :func:`init_process_group`.
    """
    if master_port == 0:
        if num_nodes > 1:
            raise ValueError("distributed.master_port must be set (the same on every node) for num_nodes > 1")
        master_port = find_free_port()
    world = nproc_per_node * num_nodes
    context = start_processes(
        _worker, (fn, args, nproc_per_node, node_rank, world, master_addr, master_port, backend, timeout_s, device),
        nproc_per_node, join=False)

    def forward(signum: int, _frame: Any) -> None:  # pre-emption signals reach the workers too
        for proc in context.processes:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        while not context.join(grace_period=EXIT_GRACE_S):
            pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def all_reduce_gradients(params: Iterable[torch.nn.Parameter], bucket_cap_mb: float = 25.0) -> None:
    """Average the gradients of ``params`` over all ranks, in flat buckets of ``bucket_cap_mb``.

    The manual counterpart of DDP's reduction (VISSL's MANUAL_GRADIENT_REDUCTION), for a
    backward run under ``no_sync``. Parameters without a gradient are skipped; each bucket
    holds gradients of one dtype and device.
    """
    if not is_distributed():
        return
    grads = [p.grad for p in params if p.grad is not None]
    world = get_world_size()
    cap = int(bucket_cap_mb * 1024 * 1024)
    buckets: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    for g in grads:
        groups = buckets.setdefault((g.dtype, g.device), [[]])
        if groups[-1] and sum(t.numel() * t.element_size() for t in groups[-1]) + g.numel() * g.element_size() > cap:
            groups.append([])
        groups[-1].append(g)
    for groups in buckets.values():
        for bucket in groups:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(world)
            offset = 0
            for g in bucket:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n
