"""The one place sslkit touches torch.distributed: rank helpers, reductions and gathers."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_mean",
    "all_reduce_sum",
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


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of ``tensor`` over all processes (a new tensor; the input is not modified).

    Uses classy-vision's collective helper, which handles the device of the backend.
    """
    if not is_distributed():
        return tensor
    from classy_vision.generic.distributed_util import all_reduce_mean as _cv_all_reduce_mean

    return _cv_all_reduce_mean(tensor.clone())


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over all processes (a new tensor)."""
    if not is_distributed():
        return tensor
    from classy_vision.generic.distributed_util import all_reduce_sum as _cv_all_reduce_sum

    return _cv_all_reduce_sum(tensor.clone())


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
