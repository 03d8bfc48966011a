"""Tests for sslkit.optim.LARS against the update rule computed by hand and against torch.optim.SGD."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from sslkit.optim import LARS


def _param(*values: float) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(values, dtype=torch.float64))


def test_two_steps_by_hand_with_weight_decay_and_momentum() -> None:
    lr, m, wd, eta = 0.5, 0.9, 0.1, 0.01
    p = _param(3.0, 4.0)  # ||p|| = 5
    opt = LARS([p], lr=lr, momentum=m, weight_decay=wd, eta=eta)
    g = [0.3, 0.4]

    # step 1: d = g + wd*p = [0.6, 0.8], ||d|| = 1; trust = eta*5/1 = 0.05; v = 0.05*d; p -= lr*v
    p.grad = torch.tensor(g, dtype=torch.float64)
    opt.step()
    trust1 = eta * 5.0 / 1.0
    v1 = [trust1 * 0.6, trust1 * 0.8]  # [0.03, 0.04]
    p1 = [3.0 - lr * v1[0], 4.0 - lr * v1[1]]  # [2.985, 3.98]
    torch.testing.assert_close(p.detach(), torch.tensor(p1, dtype=torch.float64))
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], torch.tensor(v1, dtype=torch.float64))

    # step 2: same gradient, new lr (set by the trainer); the trust ratio uses the new ||p|| and
    # ||d||, and the new lr multiplies the whole buffer (lr outside the momentum, like torch SGD)
    lr2 = 0.25
    opt.param_groups[0]["lr"] = lr2
    p.grad = torch.tensor(g, dtype=torch.float64)
    opt.step()
    d2 = [g[0] + wd * p1[0], g[1] + wd * p1[1]]
    trust2 = eta * math.hypot(*p1) / math.hypot(*d2)
    v2 = [m * v1[0] + trust2 * d2[0], m * v1[1] + trust2 * d2[1]]
    p2 = [p1[0] - lr2 * v2[0], p1[1] - lr2 * v2[1]]
    torch.testing.assert_close(p.detach(), torch.tensor(p2, dtype=torch.float64))
    # hand arithmetic: p1 = 0.995*[3,4], d2 = 0.1995*[3,4], so trust2 = eta*0.995/0.1995
    assert trust2 == pytest.approx(eta * 0.995 / 0.1995)


def test_nesterov_step_by_hand() -> None:
    lr, m, eta = 0.1, 0.9, 0.02
    p = _param(0.0, 2.0)  # ||p|| = 2
    opt = LARS([p], lr=lr, momentum=m, eta=eta, nesterov=True)
    for _ in range(2):
        p.grad = torch.tensor([0.0, 0.5], dtype=torch.float64)
        before = p.detach().clone()
        opt.step()
    # step 1: trust = 0.02*2/0.5 = 0.08; d = [0, 0.04]; v1 = d; p1 = 2 - 0.1*(0.04 + 0.9*0.04)
    v1 = 0.08 * 0.5
    p1 = 2.0 - lr * (v1 + m * v1)
    # step 2: trust = 0.02*p1/0.5; d = trust*0.5; v2 = m*v1 + d; p2 = p1 - lr*(d + m*v2)
    d2 = eta * p1 / 0.5 * 0.5
    v2 = m * v1 + d2
    p2 = p1 - lr * (d2 + m * v2)
    assert before[1].item() == pytest.approx(p1)
    torch.testing.assert_close(p.detach(), torch.tensor([0.0, p2], dtype=torch.float64))


def test_trust_ratio_is_per_tensor() -> None:
    a = _param(3.0, 4.0)  # ||a|| = 5
    b = _param(1.0, 0.0, 0.0, 0.0)  # ||b|| = 1
    opt = LARS([a, b], lr=1.0, momentum=0.0, eta=0.1)
    a.grad = torch.tensor([1.0, 0.0], dtype=torch.float64)  # trust_a = 0.1*5/1 = 0.5
    b.grad = torch.tensor([0.0, 2.0, 0.0, 0.0], dtype=torch.float64)  # trust_b = 0.1*1/2 = 0.05
    opt.step()
    torch.testing.assert_close(a.detach(), torch.tensor([2.5, 4.0], dtype=torch.float64))
    torch.testing.assert_close(b.detach(), torch.tensor([1.0, -0.1, 0.0, 0.0], dtype=torch.float64))


def test_zero_norm_param_gets_trust_one() -> None:
    p = _param(0.0, 0.0)
    opt = LARS([p], lr=0.5, momentum=0.9, eta=0.001)
    p.grad = torch.tensor([1.0, -2.0], dtype=torch.float64)
    opt.step()
    # trust 1 (not eta*0/||g|| = 0): p = -lr*g
    torch.testing.assert_close(p.detach(), torch.tensor([-0.5, 1.0], dtype=torch.float64))


def test_zero_grad_param_gets_trust_one_and_stays_finite() -> None:
    p = _param(3.0, 4.0)
    opt = LARS([p], lr=0.5, momentum=0.9, eta=0.001)
    p.grad = torch.zeros(2, dtype=torch.float64)
    opt.step()
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.detach(), torch.tensor([3.0, 4.0], dtype=torch.float64))
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], torch.zeros(2, dtype=torch.float64))


def test_eps_in_denominator() -> None:
    p = _param(3.0, 4.0)
    opt = LARS([p], lr=1.0, momentum=0.0, eta=0.1, eps=1.0)
    p.grad = torch.tensor([1.0, 0.0], dtype=torch.float64)
    opt.step()  # trust = 0.1*5/(1+1) = 0.25
    torch.testing.assert_close(p.detach(), torch.tensor([2.75, 4.0], dtype=torch.float64))


@pytest.mark.parametrize("nesterov", [False, True])
def test_excluded_group_matches_torch_sgd(nesterov: bool) -> None:
    torch.manual_seed(0)
    shapes = [(4, 3), (3,), (2, 2, 2)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = {"lr": 0.3, "momentum": 0.9, "weight_decay": 0.01, "nesterov": nesterov}
    lars = LARS([{"params": ours, "lars_exclude": True}], eta=0.001, **kw)
    sgd = torch.optim.SGD(ref, **kw)
    for step in range(4):
        grads = [torch.randn(s) for s in shapes]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        # the trainer changes lr every step; lr multiplies the buffer in both optimizers
        for opt in (lars, sgd):
            opt.param_groups[0]["lr"] = 0.3 / (step + 1)
        lars.step()
        sgd.step()
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(lars.state[p]["momentum_buffer"], sgd.state[q]["momentum_buffer"])


def test_mixed_groups_adapt_only_non_excluded() -> None:
    w = _param(3.0, 4.0)
    b = _param(3.0, 4.0)
    opt = LARS(
        [{"params": [w]}, {"params": [b], "lars_exclude": True, "weight_decay": 0.0}],
        lr=1.0,
        momentum=0.0,
        weight_decay=0.5,
        eta=0.1,
    )
    w.grad = torch.tensor([1.0, 0.0], dtype=torch.float64)
    b.grad = torch.tensor([1.0, 0.0], dtype=torch.float64)
    opt.step()
    # w: d = [1,0] + 0.5*[3,4] = [2.5, 2]; trust = 0.1*5/||d||
    d = [2.5, 2.0]
    trust = 0.1 * 5.0 / math.hypot(*d)
    torch.testing.assert_close(
        w.detach(), torch.tensor([3.0 - trust * d[0], 4.0 - trust * d[1]], dtype=torch.float64)
    )
    # b: plain SGD, no weight decay, no trust ratio
    torch.testing.assert_close(b.detach(), torch.tensor([2.0, 4.0], dtype=torch.float64))


def test_grad_untouched_and_none_grad_skipped() -> None:
    p = _param(3.0, 4.0)
    q = _param(1.0, 1.0)
    opt = LARS([p, q], lr=0.1, weight_decay=0.1)
    g = torch.tensor([0.3, 0.4], dtype=torch.float64)
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(p.grad, g)
    torch.testing.assert_close(q.detach(), torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert q not in opt.state


def test_state_dict_round_trip() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    clone = torch.nn.Linear(3, 2)
    clone.load_state_dict(model.state_dict())
    a = LARS(model.parameters(), lr=0.1, weight_decay=1e-4)
    b = LARS(clone.parameters(), lr=0.7, weight_decay=1e-4)

    def step(m: torch.nn.Module, opt: LARS, x: torch.Tensor) -> None:
        opt.zero_grad()
        m(x).square().sum().backward()
        opt.step()

    x1, x2 = torch.randn(5, 3), torch.randn(5, 3)
    step(model, a, x1)
    step(clone, b, x1 * 0)  # different history for b ...
    clone.load_state_dict(model.state_dict())
    # ... replaced by a's (buffers and lr); deepcopy as torch.save/load would (state_dict aliases buffers)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert b.param_groups[0]["lr"] == 0.1
    step(model, a, x2)
    step(clone, b, x2)
    for p, q in zip(model.parameters(), clone.parameters()):
        torch.testing.assert_close(p, q)


def test_closure_returns_loss() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = LARS([p], lr=0.1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = p.square().sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss is not None and loss.item() == pytest.approx(5.0)
    assert not torch.equal(p.detach(), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": -1.0},
        {"momentum": -0.1},
        {"weight_decay": -1.0},
        {"eta": 0.0},
        {"eps": -1.0},
        {"momentum": 0.0, "nesterov": True},
    ],
)
def test_invalid_arguments(kwargs: dict) -> None:
    args = {"lr": 0.1, **kwargs}
    with pytest.raises(ValueError):
        LARS([torch.nn.Parameter(torch.ones(2))], **args)
