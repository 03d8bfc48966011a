"""LARS: SGD with momentum and a layer-wise trust ratio (You et al., 2017), as in SimCLR and BYOL."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["LARS"]


def _trust_ratios(params: list[Tensor], grads: list[Tensor], eta: float, eps: float) -> list[Tensor]:
    """Per-tensor ``eta * ||p|| / (||g|| + eps)``, or 1 where either norm is 0 (0-d tensors)."""
    p_norms = torch._foreach_norm(params)
    g_norms = torch._foreach_norm(grads)
    out: list[Tensor | None] = [None] * len(params)
    # Stack the norms per device so the ratio is a handful of kernels, not a few per tensor.
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(params):
        by_device.setdefault(p.device, []).append(i)
    for idx in by_device.values():
        pn = torch.stack([p_norms[i].float() for i in idx])
        gn = torch.stack([g_norms[i].float() for i in idx])
        ratio = torch.where((pn > 0) & (gn > 0), eta * pn / (gn + eps), torch.ones_like(pn))
        for i, r in zip(idx, ratio.unbind(0)):
            out[i] = r.to(params[i].dtype)
    return out  # type: ignore[return-value]


class LARS(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling on top of SGD with momentum.

    For each parameter ``p`` with gradient ``g`` in a group whose ``lars_exclude`` is False::

        d     = g + weight_decay * p
        trust = eta * ||p|| / (||d|| + eps)   if ||p|| > 0 and ||d|| > 0, else 1
        d     = trust * d
        v     = momentum * v + d                      (v starts at 0)
        p     = p - lr * (d + momentum * v if nesterov else v)

    Groups with ``lars_exclude=True`` (biases and norm weights from
    :func:`~sslkit.optim.param_groups`) skip the trust ratio: they follow exactly
    ``torch.optim.SGD(momentum, weight_decay, nesterov, dampening=0)`` with the group's own
    weight decay (0.0 for the no-decay group).

    Ordering: the trust ratio scales the (weight-decayed) gradient *before* it enters the
    momentum buffer, and the learning rate multiplies the buffer *after* it, as in
    ``torch.optim.SGD`` and the PyTorch LARS of Barlow Twins / VICReg (facebookresearch). The
    TensorFlow LARS of SimCLR / BYOL puts the learning rate inside the buffer
    (``v = m * v + lr * trust * d; p -= v``); the two are identical while the learning rate is
    constant and differ only in how a changing learning rate reaches past gradients. We keep
    ``lr`` outside so that the excluded groups are exactly ``torch.optim.SGD`` and the buffer
    does not depend on the per-step learning rate the trainer sets (warmup / cosine schedules).

    The momentum buffer is kept in ``state[p]["momentum_buffer"]`` like ``torch.optim.SGD``, so
    ``state_dict`` / ``load_state_dict`` work as for any optimizer. Per-group keys: ``lr``,
    ``momentum``, ``weight_decay``, ``eta``, ``eps``, ``nesterov``, ``lars_exclude``.

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate.
        momentum: momentum factor (0 disables the buffer).
        weight_decay: L2 penalty added to the gradient before the trust ratio.
        eta: trust coefficient (0.001 in the LARS paper and SimCLR / BYOL).
        eps: added to ``||d||`` in the trust-ratio denominator.
        nesterov: use Nesterov momentum.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        eps: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"invalid momentum: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        if eta <= 0.0:
            raise ValueError(f"invalid trust coefficient eta: {eta}")
        if eps < 0.0:
            raise ValueError(f"invalid eps: {eps}")
        if nesterov and momentum <= 0.0:
            raise ValueError("nesterov momentum requires momentum > 0")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "eta": eta,
            "eps": eps,
            "nesterov": nesterov,
            "lars_exclude": False,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LARS does not support sparse gradients")
                params.append(p)
                grads.append(p.grad)
            if not params:
                continue

            lr: float = group["lr"]
            momentum: float = group["momentum"]
            wd: float = group["weight_decay"]

            # d = g + wd * p (new tensors: p.grad is left untouched)
            if wd != 0.0:
                d = list(torch._foreach_add(grads, params, alpha=wd))
            else:
                d = [g.clone() for g in grads]

            if not group["lars_exclude"]:
                trust = _trust_ratios(params, d, group["eta"], group["eps"])
                torch._foreach_mul_(d, trust)

            if momentum != 0.0:
                bufs: list[Tensor] = []
                for p in params:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["momentum_buffer"] = buf
                    bufs.append(buf)
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, d)
                if group["nesterov"]:
                    torch._foreach_add_(d, bufs, alpha=momentum)
                else:
                    d = bufs

            torch._foreach_add_(params, d, alpha=-lr)

        return loss
