"""Method: one SSL method as one object, declared in its own file: wiring, loss, required hooks, augmentation."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sslkit import registry as R

__all__ = ["Method", "RunShape", "register_method"]


@dataclass(frozen=True)
class RunShape:
    """What a method's own config rules (:attr:`Method.rules`) see of a run: plain values, no config object."""

    #: images per process and micro-batch (``data.batch_size``, or ``data.global_batch_size`` split)
    batch_per_process: int
    #: processes of the run
    processes: int
    #: the ``loss`` section and ``model.kwargs``, as plain keyword arguments
    loss: dict[str, Any]
    model_kwargs: dict[str, Any]
    #: the method's hooks' settings (``method.hooks``, by hook name; None entries left out)
    hooks: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the optimizer steps the run makes, when the number of training samples is known before the data is
    #: opened (``data.limit``, Fashion-MNIST, a synthetic source); None otherwise
    steps: int | None = None
    #: the config the method declares as its own (:attr:`Method.sections`), by key path (``gram``, ``distill``)
    sections: dict[str, Any] = field(default_factory=dict)
    #: the registered trunk (``model.trunk``), the training transform's settings (``data.transform``) and the
    #: high-resolution phase's (``hires``)
    trunk: str | None = None
    transform: dict[str, Any] = field(default_factory=dict)
    hires: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """What a method is made of, so that a recipe only picks it (``method.name``) and tunes it.

    * ``model``: the registered model builder that wires trunk, head, predictor and teacher
      (``model.name`` defaults to it);
    * ``loss``: the registered loss (``loss.name`` defaults to it); the loss's keyword arguments are
      the method's ``loss.*`` keys;
    * ``required_hooks``: the hooks the method cannot train without (a momentum teacher that must
      move, prototypes that must stay normalised). The recipe gives their settings under
      ``method.hooks.<name>``; a config that drops one is an error naming it;
    * ``transform``: the default augmentation (``data.transform.name`` defaults to it);
    * ``masking``: the mask generator the method trains with (``masking.name`` defaults to it; a method
      with one cannot train with ``masking.name=none``); None for methods without masks;
    * ``takes_masks``: a method without a mask generator of its own whose model takes masks when the config gives
      some (distillation's ``dino`` objective for ViT students): ``masking.name`` may be set or ``none``;
    * ``patch_tokens``: the method reads a ViT's patch tokens (a CNN trunk is then a config error);
    * ``rules``: the method's own config checks, run by validation with the run's :class:`RunShape`; each returns
      the messages of what does not hold (none when all is well), so a user's method adds its rules without
      editing sslkit;
    * ``sections``: key paths of the config that only this method reads (``gram`` for DINOv3's Gram anchoring,
      ``distill`` for distillation): given to its rules in :attr:`RunShape.sections`, and a config error when
      they differ from their defaults in a run of another method;
    * ``complete``: fills, on the composed config before it is validated, keys the method derives from its own
      sections and the config left open (null), so the saved config says what ran (distillation: ``model.trunk``
      from its first student); None for most methods;
    * ``summary``: one line for ``sslkit list``.

    The keys the method accepts are those of its builders: ``model.kwargs`` for the model's,
    ``loss`` for the loss's (checked against their signatures, with did-you-mean).
    """

    name: str
    model: str
    loss: str
    required_hooks: tuple[str, ...] = ()
    transform: str = "simclr"
    masking: str | None = None
    takes_masks: bool = False
    patch_tokens: bool = False
    rules: tuple[Callable[[RunShape], list[str]], ...] = ()
    sections: tuple[str, ...] = ()
    complete: Callable[[Any], None] | None = None
    summary: str = ""

    def accepted_keys(self) -> dict[str, list[str]]:
        """The config keys of this method, by section: ``model.kwargs`` and ``loss``."""
        return {"model.kwargs": _arguments(R.get(R.MODELS, self.model), skip=("trunk", "head")),
                "loss": _arguments(R.get(R.LOSSES, self.loss))}


def _arguments(builder: Callable[..., Any], skip: tuple[str, ...] = ()) -> list[str]:
    target = builder.__init__ if inspect.isclass(builder) else builder
    params = inspect.signature(target).parameters.values()
    return [p.name for p in params if p.name not in ("self", *skip) and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def register_method(method: Method) -> Method:
    """Register ``method`` under its name (``method.name`` in a recipe) and return it."""
    R.METHODS._do_register(method.name, method)
    return method
