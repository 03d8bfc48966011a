"""SSLHook, the base class of every hook (with Event, the moments at which hooks run, and Slot, their order)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from sslkit.events import Event, Slot, in_order

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["Event", "SSLHook", "Slot", "in_order", "method_model"]

#: The model class a method's hook works on.
M = TypeVar("M")


def method_model(task: SSLTask, kind: type[M], hook: str, method: str, error: type[Exception] = ValueError) -> M:
    """``task``'s model (unwrapped from DDP) when it is a ``kind``; else ``error`` saying that hook ``hook`` belongs to
    ``method.name=<method>``: what a method's own hook asks of the model it moves or watches."""
    model = task.base_model
    if not isinstance(model, kind):
        raise error(f"method.hooks.{hook} works on method.name={method}'s model, and the model is "
                    f"{type(model).__name__}: use it with method.name={method}")
    return model


class SSLHook:
    """Base class of hooks: override only the events you need; the others do nothing.

    A hook that keeps state across steps returns it from :meth:`state_dict` and takes it back
    in :meth:`load_state_dict`; the checkpoint stores it under the hook's :attr:`name`.
    :attr:`slot` places it among the other hooks (:class:`Slot`).
    """

    #: Key under which the hook's state is checkpointed; the registry name by default.
    name: str = ""
    #: Where the hook runs among the others at every event (:class:`Slot`).
    slot: Slot = Slot.METHOD

    def on_start(self, task: SSLTask) -> None:
        """Once, before the first phase (after a resume, the restored state is in place)."""

    def on_phase_start(self, task: SSLTask) -> None:
        """At the start of each phase (train epoch or eval pass)."""

    def on_forward(self, task: SSLTask) -> None:
        """After the model's forward; ``task.last_batch.model_output`` is set."""

    def on_loss_and_meter(self, task: SSLTask) -> None:
        """After the loss is computed, all-reduced and metered; ``task.last_batch.loss`` is set."""

    def on_backward(self, task: SSLTask) -> None:
        """Train phases: after backward (and any manual gradient reduction), before the step."""

    def on_update(self, task: SSLTask) -> None:
        """Train phases: after the optimizer step (EMA teachers update here)."""

    def on_step(self, task: SSLTask) -> None:
        """After every step, train or eval."""

    def on_phase_end(self, task: SSLTask) -> None:
        """At the end of each phase."""

    def on_end(self, task: SSLTask) -> None:
        """Once, after the last phase of a run that completed."""

    def on_exception(self, task: SSLTask) -> None:
        """When any exception escapes the loop; ``task.exception`` holds it. Then re-raised."""

    def before_checkpoint(self, task: SSLTask) -> None:
        """On every rank just before a checkpoint is taken (after the update guard's check). A hook
        may raise here to keep a bad state out of the checkpoints."""

    def on_halt(self, task: SSLTask) -> None:
        """When the update guard halts the run (``task.exception`` is the :class:`TrainingHalted`),
        before ``on_exception``; the checkpoint hook writes the crash state here."""

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (empty for stateless hooks)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
