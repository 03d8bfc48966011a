"""Tests for sslkit.optim.build_optimizer, set_lr and set_weight_decay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sslkit.optim import LARS, build_optimizer, set_lr, set_weight_decay


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def _zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _is_weight(name: str, model: nn.Module) -> bool:
    return model.get_parameter(name).ndim > 1


@pytest.mark.parametrize(
    ("name", "cls"),
    [("sgd", torch.optim.SGD), ("lars", LARS), ("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam)],
)
def test_builds_each_type_with_groups(name: str, cls: type) -> None:
    model = _model()
    opt = build_optimizer(model, name, lr=0.2, weight_decay=0.01)
    assert type(opt) is cls
    groups = {g["name"]: g for g in opt.param_groups}
    assert set(groups) == {"decay", "no_decay"}
    assert groups["decay"]["weight_decay"] == 0.01 and groups["decay"]["apply_wd"] is True
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["no_decay"]["apply_wd"] is False
    assert all(g["lr"] == 0.2 for g in opt.param_groups)
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert n_params == len(list(model.parameters()))


def test_hyperparameters_reach_the_optimizer() -> None:
    model = _model()
    sgd = build_optimizer(model, "sgd", lr=0.1, momentum=0.8, nesterov=True)
    assert sgd.param_groups[0]["momentum"] == 0.8 and sgd.param_groups[0]["nesterov"] is True
    lars = build_optimizer(model, "lars", lr=0.1, momentum=0.7, eta=0.02)
    g = lars.param_groups[0]
    assert (g["momentum"], g["eta"], g["lars_exclude"]) == (0.7, 0.02, False)
    assert lars.param_groups[1]["lars_exclude"] is True
    adamw = build_optimizer(model, "adamw", lr=0.1, betas=(0.8, 0.95))
    assert adamw.param_groups[0]["betas"] == (0.8, 0.95)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_weight_decay_not_applied_to_bias_and_norm(name: str) -> None:
    lr, wd = 0.5, 0.1
    model = _model()
    opt = build_optimizer(model, name, lr=lr, weight_decay=wd)
    before = _snapshot(model)
    _zero_grads(model)
    opt.step()
    for n, p in model.named_parameters():
        if _is_weight(n, model):
            # SGD (first step, buffer = wd*w) and AdamW (decoupled) both shrink w by lr*wd*w
            torch.testing.assert_close(p.detach(), before[n] - lr * wd * before[n])
        else:
            torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)


def test_lars_weight_decay_not_applied_to_bias_and_norm() -> None:
    lr, wd, eta = 0.5, 0.1, 0.01
    model = _model()
    opt = build_optimizer(model, "lars", lr=lr, weight_decay=wd, eta=eta)
    before = _snapshot(model)
    _zero_grads(model)
    opt.step()
    for n, p in model.named_parameters():
        if _is_weight(n, model):
            # d = wd*w, trust = eta*||w||/(wd*||w||) = eta/wd, so w -= lr*eta*w
            torch.testing.assert_close(p.detach(), before[n] - lr * eta * before[n])
        else:
            torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)


def test_without_exclusion_bias_is_decayed() -> None:
    lr, wd = 0.5, 0.1
    model = _model()
    opt = build_optimizer(model, "sgd", lr=lr, weight_decay=wd, exclude_bias_and_norm=False)
    assert len(opt.param_groups) == 1
    before = _snapshot(model)
    _zero_grads(model)
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n] * (1 - lr * wd))


def test_unknown_name_suggests_closest() -> None:
    with pytest.raises(ValueError, match="Did you mean 'lars'") as info:
        build_optimizer(_model(), "lasr", lr=0.1)
    assert all(n in str(info.value) for n in ("adam", "adamw", "lars", "sgd"))
    with pytest.raises(ValueError, match="Did you mean 'adamw'"):
        build_optimizer(_model(), "adam_w", lr=0.1)


def test_no_trainable_parameters() -> None:
    model = _model().requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        build_optimizer(model, "sgd", lr=0.1)


def test_set_lr_respects_lr_scale() -> None:
    model = _model()
    opt = build_optimizer(model, "lars", lr=0.1)
    opt.param_groups[1]["lr_scale"] = 0.1
    set_lr(opt, 2.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0)
    assert opt.param_groups[1]["lr"] == pytest.approx(0.2)


def test_set_lr_changes_the_step() -> None:
    model = nn.Linear(2, 1, bias=False)
    opt = build_optimizer(model, "sgd", lr=1.0, momentum=0.0)
    set_lr(opt, 0.25)
    before = model.weight.detach().clone()
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    torch.testing.assert_close(model.weight.detach(), before - 0.25)


def test_set_weight_decay_only_on_decay_groups() -> None:
    model = _model()
    opt = build_optimizer(model, "sgd", lr=0.5, weight_decay=0.1, momentum=0.0)
    set_weight_decay(opt, 0.4)
    groups = {g["name"]: g for g in opt.param_groups}
    assert groups["decay"]["weight_decay"] == 0.4
    assert groups["no_decay"]["weight_decay"] == 0.0
    # the new value is what the next step uses
    before = _snapshot(model)
    _zero_grads(model)
    opt.step()
    for n, p in model.named_parameters():
        expected = before[n] * (1 - 0.5 * 0.4) if _is_weight(n, model) else before[n]
        torch.testing.assert_close(p.detach(), expected)
    # a schedule may pass through 0 and come back
    set_weight_decay(opt, 0.0)
    set_weight_decay(opt, 0.2)
    assert groups["decay"]["weight_decay"] == 0.2 and groups["no_decay"]["weight_decay"] == 0.0


def test_set_weight_decay_when_built_with_zero() -> None:
    # a weight-decay schedule starting at 0 still reaches the weights, never the biases
    opt = build_optimizer(_model(), "adamw", lr=0.1, weight_decay=0.0)
    set_weight_decay(opt, 0.05)
    groups = {g["name"]: g for g in opt.param_groups}
    assert groups["decay"]["weight_decay"] == 0.05
    assert groups["no_decay"]["weight_decay"] == 0.0


def test_set_weight_decay_on_plain_groups_uses_original_value() -> None:
    a, b = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD(
        [{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=0.1
    )
    set_weight_decay(opt, 0.3)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]


def test_optimizer_state_dict_keeps_group_flags() -> None:
    model = _model()
    opt = build_optimizer(model, "lars", lr=0.1, weight_decay=0.01)
    _zero_grads(model)
    opt.step()
    fresh = build_optimizer(model, "lars", lr=0.9, weight_decay=0.01)
    fresh.load_state_dict(opt.state_dict())
    assert [g["name"] for g in fresh.param_groups] == ["decay", "no_decay"]
    assert [g["apply_wd"] for g in fresh.param_groups] == [True, False]
    assert [g["lars_exclude"] for g in fresh.param_groups] == [False, True]
    assert fresh.param_groups[0]["lr"] == 0.1
