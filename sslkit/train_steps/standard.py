"""standard_train_step: the composition of the stages (sample, forward and loss, reduce, backward, update)."""

from __future__ import annotations

from sslkit.registry import register_train_step
from sslkit.task import SSLTask
from sslkit.train_steps.stages import forward_backward, run_micro_batches, update

__all__ = ["standard_train_step"]


@register_train_step("standard")
def standard_train_step(task: SSLTask) -> None:
    """One step: ``update(task, run_micro_batches(task, forward_backward))`` (sslkit/train_steps/stages.py).

    With ``optim.micro_batches = K`` (train phases) it runs K micro-batches, each forward followed by
    ``backward(loss / K)``, DDP's reduction only after the last, then one optimizer update; ``on_forward`` and
    ``on_loss_and_meter`` fire per micro-batch, ``on_backward`` and ``on_update`` once. Raises StopIteration when
    the phase's data runs out. No host-device synchronisation happens here (the skip policies of the update guard
    read one flag per step: docs/reliability.md).
    """
    update(task, run_micro_batches(task, forward_backward))
