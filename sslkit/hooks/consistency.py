"""ConsistencyCheckHook: every N steps, compare a checksum of the parameters across ranks; stop on divergence."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sslkit.distributed import gather_no_grad, is_distributed
from sslkit.hooks.base import Slot, SSLHook
from sslkit.registry import register_hook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["ConsistencyCheckHook", "RanksDivergedError", "parameter_checksum"]


class RanksDivergedError(RuntimeError):
    """The ranks hold different weights: data-parallel training has gone wrong."""


def parameter_checksum(model: torch.nn.Module) -> torch.Tensor:
    """A float64 checksum of every parameter (sum and a position-weighted sum), shape [2], on device."""
    total = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for i, p in enumerate(model.parameters()):
        v = p.detach().double()
        total[0] += v.sum()
        total[1] += (i + 1) * v.abs().sum()
    return total


@register_hook("consistency_check")
class ConsistencyCheckHook(SSLHook):
    """After every ``every_n_steps``-th optimizer step, gather each rank's parameter checksum and
    raise :class:`RanksDivergedError` naming the step and the ranks that differ from rank 0.

    DDP keeps replicas identical by construction; a custom step or hook that updates ranks
    differently (a rank-dependent random op, a missed all-reduce) breaks that silently. The check
    syncs the host once per interval; every rank raises together, so no rank is left waiting.
    """

    name = "consistency_check"
    slot = Slot.MONITOR

    def __init__(self, every_n_steps: int = 100) -> None:
        self.every_n_steps = every_n_steps

    def on_step(self, task: SSLTask) -> None:
        """Compare the checksums at the interval (train phases, several ranks only)."""
        if not (task.train and is_distributed() and self.every_n_steps > 0
                and task.clock.step % self.every_n_steps == 0):
            return
        sums = gather_no_grad(parameter_checksum(task.base_model)[None]).cpu()
        diverged = [r for r in range(1, sums.shape[0]) if not torch.equal(sums[r], sums[0])]
        if diverged:
            raise RanksDivergedError(
                f"step {task.clock.step}: the parameters of rank(s) {diverged} differ from rank 0 "
                f"(checksums {sums.tolist()}). Data-parallel replicas must stay identical: look for a "
                "custom step or hook that updates weights differently on each rank."
            )
