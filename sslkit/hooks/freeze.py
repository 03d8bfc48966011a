"""FreezeParametersHook: parameters frozen by name for the first N steps or epochs (``model.freeze``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sslkit.hooks.base import SSLHook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["FreezeParametersHook"]


class FreezeParametersHook(SSLHook):
    """Drop the gradients of named parameters while they are frozen, after backward (``on_backward``).

    Each entry ``(names, unit, n)`` freezes the parameters ``names`` (full names in the model, without a DDP
    wrapper's prefix) while ``task.clock.step < n`` (``unit`` ``steps``) or ``task.clock.epoch < n``
    (``epochs``). A dropped gradient is ``None``, as DINO's ``cancel_gradients_last_layer`` leaves it, so
    the optimizer skips the parameter altogether: no update, no weight decay, no moment estimates; the
    gradient norm and its clipping (``optim.clip_grad``, in the update stage, after this hook) leave it
    out. Parameters frozen for the whole run never reach the optimizer (``requires_grad=False``, set
    when the model is built: :func:`sslkit.builder.freeze_parameters`). The schedule runs on the
    training clock, so a resumed run freezes exactly what the uninterrupted one does; no state.
    """

    name = "freeze_parameters"

    def __init__(self, entries: list[tuple[list[str], str, int]]) -> None:
        for _, unit, n in entries:
            if unit not in ("steps", "epochs") or n < 0:
                raise ValueError(f"a frozen span is (names, 'steps' | 'epochs', n >= 0), got ({unit!r}, {n})")
        self.entries = [(list(names), unit, int(n)) for names, unit, n in entries]

    def frozen(self, task: SSLTask) -> list[str]:
        """The names frozen at the clock's current update and epoch."""
        out: list[str] = []
        for names, unit, n in self.entries:
            now = task.clock.step if unit == "steps" else task.clock.epoch
            if now < n:
                out += names
        return out

    def on_backward(self, task: SSLTask) -> None:
        """``grad = None`` for every parameter frozen now."""
        names = self.frozen(task)
        if not names:
            return
        params = dict(task.base_model.named_parameters())
        for name in names:
            params[name].grad = None
