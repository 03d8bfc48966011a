"""FreezeParametersHook, the one mechanism behind model.freeze and the methods' own freezes: names and globs matched
against the model when first frozen, the span on the training clock, a glob that matches nothing named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sslkit.clock import TrainClock
from sslkit.hooks.freeze import FreezeParametersHook
from sslkit.methods.dino import FreezeLastLayerHook
from sslkit.methods.swav import SwAVPrototypesHook


def _task(model: nn.Module, step: int = 0, epoch: int = 0) -> SimpleNamespace:
    clock = TrainClock()
    clock.step, clock.epoch = step, epoch
    return SimpleNamespace(base_model=model, clock=clock)


def _model() -> nn.Module:
    model = nn.ModuleDict({"trunk": nn.Linear(3, 3), "head": nn.ModuleDict({"mlp": nn.Linear(3, 2),
                                                                           "last_layer": nn.Linear(2, 4)})})
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    return model


def test_names_and_globs_are_frozen_for_their_span_only() -> None:
    model = _model()
    hook = FreezeParametersHook([(["trunk.weight"], "steps", 2), (["head.*"], "epochs", 1)])
    assert hook.frozen(_task(model, step=1)) == ["trunk.weight", "head.mlp.weight", "head.mlp.bias",
                                                "head.last_layer.weight", "head.last_layer.bias"]
    assert hook.frozen(_task(model, step=2, epoch=0)) == ["head.mlp.weight", "head.mlp.bias",
                                                          "head.last_layer.weight", "head.last_layer.bias"]
    assert hook.frozen(_task(model, step=5, epoch=1)) == []
    hook.on_backward(_task(model, step=2))
    assert model["trunk"].weight.grad is not None and model["trunk"].bias.grad is not None
    assert all(p.grad is None for p in model["head"].parameters())


def test_the_methods_freezes_are_this_hook_and_name_their_setting_when_nothing_matches() -> None:
    model = _model()
    dino = FreezeLastLayerHook(freeze_last_layer_epochs=1)
    assert isinstance(dino, FreezeParametersHook) and isinstance(SwAVPrototypesHook(), FreezeParametersHook)
    dino.on_backward(_task(model, epoch=0))
    assert model["head"]["last_layer"].weight.grad is None and model["head"]["mlp"].weight.grad is not None
    FreezeLastLayerHook(freeze_last_layer_epochs=0).on_backward(_task(nn.Linear(2, 2)))  # never frozen: no lookup
    with pytest.raises(AttributeError, match=r"dino_freeze_last_layer: no parameter of the model matches "
                                             r"head.last_layer.\* \(use model.name=dino"):
        dino.on_backward(_task(nn.Linear(2, 2), epoch=0))
