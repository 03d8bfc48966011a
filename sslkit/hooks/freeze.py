"""FreezeParametersHook: the one mechanism that freezes parameters for the first N steps or epochs."""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sslkit.hooks.base import SSLHook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["FreezeParametersHook"]

_WILDCARDS = ("*", "?", "[")


class FreezeParametersHook(SSLHook):
    """Drop the gradients of named parameters while they are frozen, after backward (``on_backward``).

    Each entry ``(patterns, unit, n)`` freezes the parameters whose full names in the model (without a DDP
    wrapper's prefix) are, or match the glob of, one of ``patterns`` while ``task.clock.step < n`` (``unit``
    ``steps``) or ``task.clock.epoch < n`` (``epochs``). A dropped gradient is ``None``, as DINO's
    ``cancel_gradients_last_layer`` leaves it, so the optimizer skips the parameter altogether: no update, no
    weight decay, no moment estimates; the gradient norm and its clipping (``optim.clip_grad``, in the update
    stage, after this hook) leave it out. The schedule runs on the training clock, so a resumed run freezes exactly
    what the uninterrupted one does; no state.

    Every freeze for a span is this hook: ``model.freeze`` (the builder gives the names its globs matched; those
    frozen for the whole run never reach the optimizer, :func:`sslkit.builder.freeze_parameters`), and the methods'
    own, which subclass it with their settings (DINO's last layer for the first epoch, SwAV's prototypes for the
    first steps). Patterns are matched against the model when an entry is first frozen; one that matches nothing
    raises :class:`AttributeError` with ``hint``.
    """

    name = "freeze_parameters"
    #: what to do when a pattern matches no parameter (a subclass names its own setting)
    hint = "check model.freeze's globs against model.named_parameters()"

    def __init__(self, entries: Sequence[tuple[Sequence[str], str, int]]) -> None:
        for _, unit, n in entries:
            if unit not in ("steps", "epochs") or n < 0:
                raise ValueError(f"a frozen span is (names, 'steps' | 'epochs', n >= 0), got ({unit!r}, {n})")
        self.entries = [(list(patterns), unit, int(n)) for patterns, unit, n in entries]
        self._names: weakref.WeakKeyDictionary[object, dict[int, list[str]]] = weakref.WeakKeyDictionary()

    def _matched(self, task: SSLTask, i: int) -> list[str]:
        """The parameter names entry ``i`` freezes (matched once per model)."""
        found = self._names.setdefault(task.base_model, {})
        if i not in found:
            patterns = self.entries[i][0]
            exact = {p for p in patterns if not any(c in p for c in _WILDCARDS)}
            globs = [p for p in patterns if p not in exact]
            names = [n for n, _ in task.base_model.named_parameters()
                     if n in exact or any(fnmatch.fnmatchcase(n, g) for g in globs)]
            if not names:
                raise AttributeError(f"{self.name}: no parameter of the model matches {', '.join(patterns)} "
                                     f"({self.hint})")
            found[i] = names
        return found[i]

    def frozen(self, task: SSLTask) -> list[str]:
        """The names frozen at the clock's current step and epoch."""
        out: list[str] = []
        for i, (_, unit, n) in enumerate(self.entries):
            now = task.clock.step if unit == "steps" else task.clock.epoch
            if now < n:
                out += self._matched(task, i)
        return out

    def on_backward(self, task: SSLTask) -> None:
        """``grad = None`` for every parameter frozen now."""
        names = self.frozen(task)
        if not names:
            return
        params = dict(task.base_model.named_parameters())
        for name in names:
            params[name].grad = None
