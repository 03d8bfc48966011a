"""Registries (fvcore ``Registry``) that map config names to train steps, hooks, losses, models and data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fvcore.common.registry import Registry

from sslkit.errors import did_you_mean

__all__ = [
    "DATASETS",
    "HEADS",
    "HOOKS",
    "LOSSES",
    "MASKINGS",
    "METHODS",
    "MODELS",
    "REGISTRIES",
    "TRAIN_STEPS",
    "TRANSFORMS",
    "TRUNKS",
    "UnknownNameError",
    "get",
    "register_dataset",
    "register_head",
    "register_hook",
    "register_loss",
    "register_masking",
    "register_model",
    "register_train_step",
    "register_transform",
    "register_trunk",
]

T = TypeVar("T")

TRAIN_STEPS = Registry("train_step")
TRAIN_STEPS.__doc__ = "Train steps: ``step(task) -> None``, picked by the config key ``train_step``."
HOOKS = Registry("hook")
HOOKS.__doc__ = ("SSLHook subclasses: a method's under ``method.hooks: {name: {<kwargs>}}``, more added with "
                 "``hooks: [{name: ..., <kwargs>}]``.")
LOSSES = Registry("loss")
LOSSES.__doc__ = ("Loss modules: ``loss(model_output, sample[, ctx]) -> Tensor`` (or a dict with a ``loss`` key); "
                  "``ctx`` is the step context (:class:`sslkit.clock.StepContext`).")
TRUNKS = Registry("trunk")
TRUNKS.__doc__ = "Trunk builders: ``build(in_channels=..., **kwargs) -> nn.Module`` with ``out_dim``."
HEADS = Registry("head")
HEADS.__doc__ = "Head builders: ``build(in_dim=..., **kwargs) -> nn.Module``."
MODELS = Registry("model")
MODELS.__doc__ = (
    "Model builders, one per method wiring: ``build(trunk=..., head=..., **kwargs) -> nn.Module`` whose "
    "forward takes the list of views and returns a dict of per-view outputs."
)
DATASETS = Registry("dataset")
DATASETS.__doc__ = "Data sources: ``build(split=..., path=..., **kwargs) -> Dataset`` of (image, label)."
TRANSFORMS = Registry("transform")
TRANSFORMS.__doc__ = "Transform builders: ``build(**kwargs) -> callable(uint8 image) -> list of views``."
MASKINGS = Registry("masking")
MASKINGS.__doc__ = ("Mask generators (:mod:`sslkit.models.masking`): ``build(**kwargs) -> generator``, called with a "
                    "batch's sample keys and a patch grid; picked by ``masking.name``.")
METHODS = Registry("method")
METHODS.__doc__ = ("SSL methods (:class:`sslkit.methods.base.Method`): model wiring, loss, required hooks, default "
                   "augmentation; picked by ``method.name``.")

REGISTRIES: dict[str, Registry] = {
    r._name: r for r in (TRAIN_STEPS, HOOKS, LOSSES, TRUNKS, HEADS, MODELS, DATASETS, TRANSFORMS, MASKINGS, METHODS)
}


class UnknownNameError(KeyError):
    """A name asked of a registry that is not registered in it."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


def get(registry: Registry, name: str, where: str | None = None) -> Any:
    """Look ``name`` up in ``registry``; raise :class:`UnknownNameError` naming the closest match.

    ``where`` names the config key the name came from, for the message.
    """
    names = sorted(k for k, _ in registry)
    if name in names:
        return registry.get(name)
    key = f" (config key '{where}')" if where else ""
    msg = f"unknown {registry._name} '{name}'{key}.{did_you_mean(str(name), names)}"
    msg += f" Registered {registry._name}s: {', '.join(names) or '(none)'}."
    msg += " To add your own, register it with @register_" + registry._name
    msg += " in a module and name that module in imports=[...]."
    raise UnknownNameError(msg)


def _decorator(registry: Registry) -> Callable[[str], Callable[[T], T]]:
    def register(name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            registry._do_register(name, obj)
            return obj

        return deco

    register.__doc__ = f"Register the decorated object in the {registry._name} registry under ``name``."
    return register


register_train_step = _decorator(TRAIN_STEPS)
register_hook = _decorator(HOOKS)
register_loss = _decorator(LOSSES)
register_trunk = _decorator(TRUNKS)
register_head = _decorator(HEADS)
register_model = _decorator(MODELS)
register_dataset = _decorator(DATASETS)
register_transform = _decorator(TRANSFORMS)
register_masking = _decorator(MASKINGS)
