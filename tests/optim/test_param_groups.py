"""Tests for sslkit.optim.param_groups: which parameters get weight decay and LARS adaptation."""

from __future__ import annotations

import torch
from torch import nn

from sslkit.optim import param_groups


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),  # 0: weight (decay), bias (no decay)
        nn.BatchNorm2d(4),  # 1: weight, bias (no decay)
        nn.GroupNorm(2, 4),  # 2: weight, bias (no decay)
        nn.Flatten(),
        nn.Linear(4, 8),  # 4: weight (decay), bias (no decay)
        nn.LayerNorm(8),  # 5: weight, bias (no decay)
        nn.Linear(8, 2),  # 6: frozen
    )
    for p in model[6].parameters():
        p.requires_grad_(False)
    return model


def _ids(params: list[nn.Parameter]) -> set[int]:
    return {id(p) for p in params}


def test_bias_and_norm_weights_go_to_no_decay_group() -> None:
    model = _model()
    groups = param_groups(model, weight_decay=0.05)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"decay", "no_decay"}

    decay, no_decay = by_name["decay"], by_name["no_decay"]
    assert _ids(decay["params"]) == {id(model[0].weight), id(model[4].weight)}
    assert _ids(no_decay["params"]) == {
        id(model[0].bias),
        id(model[1].weight),
        id(model[1].bias),
        id(model[2].weight),
        id(model[2].bias),
        id(model[4].bias),
        id(model[5].weight),
        id(model[5].bias),
    }
    assert decay["weight_decay"] == 0.05 and decay["lars_exclude"] is False and decay["apply_wd"] is True
    assert no_decay["weight_decay"] == 0.0 and no_decay["lars_exclude"] is True
    assert no_decay["apply_wd"] is False


def test_every_trainable_param_exactly_once_and_frozen_excluded() -> None:
    model = _model()
    groups = param_groups(model, weight_decay=0.05)
    listed = [p for g in groups for p in g["params"]]
    assert len(listed) == len(_ids(listed))  # no duplicates
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert _ids(listed) == trainable
    assert not _ids(listed) & {id(p) for p in model[6].parameters()}
    # BatchNorm running stats are buffers, not parameters
    assert id(model[1].running_mean) not in _ids(listed)


def test_shared_parameter_listed_once() -> None:
    a = nn.Linear(4, 4)
    b = nn.Linear(4, 4)
    b.weight = a.weight  # tied
    groups = param_groups(nn.Sequential(a, b), weight_decay=0.1)
    listed = [p for g in groups for p in g["params"]]
    assert len(listed) == 3  # tied weight, a.bias, b.bias
    assert sum(p is a.weight for p in listed) == 1


def test_without_exclusion_single_decay_group() -> None:
    model = _model()
    groups = param_groups(model, weight_decay=0.05, exclude_bias_and_norm=False)
    assert len(groups) == 1
    (g,) = groups
    assert g["name"] == "decay" and g["weight_decay"] == 0.05 and g["lars_exclude"] is False
    assert _ids(g["params"]) == {id(p) for p in model.parameters() if p.requires_grad}


def test_empty_groups_dropped() -> None:
    groups = param_groups(nn.Linear(3, 2, bias=False), weight_decay=0.1)
    assert [g["name"] for g in groups] == ["decay"]
    groups = param_groups(nn.LayerNorm(5), weight_decay=0.1)
    assert [g["name"] for g in groups] == ["no_decay"]
    frozen = nn.Linear(3, 2).requires_grad_(False)
    assert param_groups(frozen, weight_decay=0.1) == []


def test_groups_accepted_by_torch_optimizers() -> None:
    model = _model()
    opt = torch.optim.SGD(param_groups(model, 0.05), lr=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
