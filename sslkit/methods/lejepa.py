"""LeJEPA (Balestriero & LeCun, 2025): views predict the global views' mean embedding; SIGReg keeps them Gaussian."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from sslkit.clock import StepContext
from sslkit.data.seeding import mix_seed
from sslkit.distributed import all_reduce_sum_with_grad, get_world_size, is_distributed
from sslkit.methods.base import Method, register_method
from sslkit.registry import register_loss

__all__ = ["LEJEPA", "LeJEPALoss", "epps_pulley", "epps_pulley_knots", "lejepa_loss", "slice_directions"]

#: Salt of the slice directions' seed (independent of every other stream of the run).
_DIRECTIONS_SALT = 0x4C654A45  # "LeJE"


def epps_pulley_knots(knots: int = 17, t_max: float = 3.0, device: torch.device | str = "cpu"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The integration knots ``t`` ``[T]`` and weights ``[T]`` of the Epps-Pulley statistic, as LeJEPA's reference
    code (``lejepa/univariate/epps_pulley.py``): ``t = linspace(0, t_max, knots)``, the trapezoid rule on
    ``[-t_max, t_max]`` folded onto ``t >= 0`` (the integrand is even: weights ``2 dt``, ``dt`` at both ends),
    times the weight function ``exp(-t**2 / 2)``. ``knots`` must be odd (as there)."""
    if knots < 3 or knots % 2 == 0:
        raise ValueError(f"lejepa knots must be odd and >= 3, got {knots}")
    if t_max <= 0:
        raise ValueError(f"lejepa t_max must be > 0, got {t_max}")
    t = torch.linspace(0.0, t_max, knots, device=device, dtype=torch.float32)
    dt = t_max / (knots - 1)
    weights = torch.full((knots,), 2 * dt, device=device, dtype=torch.float32)
    weights[0] = dt
    weights[-1] = dt
    return t, weights * torch.exp(-0.5 * t * t)


def slice_directions(dim: int, num: int, update: int, device: torch.device) -> torch.Tensor:
    """``num`` random unit directions ``[dim, num]`` for the optimizer update ``update``: a generator on ``device``
    seeded by the update, so every rank (and every micro-batch of an update) draws the same ones, and a
    resumed run the same as an uninterrupted one; nothing to checkpoint. (LeJEPA's Algorithm 1 seeds by
    ``global_step``; its library all-reduces the step first, which the training clock makes unnecessary.)"""
    g = torch.Generator(device=device)
    g.manual_seed(mix_seed(_DIRECTIONS_SALT, update))
    a = torch.randn(dim, num, generator=g, device=device, dtype=torch.float32)
    return a / a.norm(dim=0, keepdim=True)


def epps_pulley(x: torch.Tensor, t: torch.Tensor, weights: torch.Tensor, gather: bool = True) -> torch.Tensor:
    r"""The Epps-Pulley statistic of each column of ``x`` ``[N, M]`` against N(0, 1), ``[M]``.

    With the empirical characteristic function of a column's samples over the *global* batch,

    .. math::

        \hat\varphi(t) = \frac{1}{N} \sum_n e^{i t x_n}, \qquad
        EP = N \int |\hat\varphi(t) - e^{-t^2/2}|^2 \, e^{-t^2/2} \, dt

    integrated with :func:`epps_pulley_knots`: ``EP = N sum_k w_k [(mean cos(t_k x) - exp(-t_k^2/2))^2 +
    (mean sin(t_k x))^2]``. It is near 0 for Gaussian samples and grows with N for others. The means are sums
    over samples, so with ``gather`` and several processes their sums are all-reduced (with gradient: every
    rank's loss is the statistic of the global batch) and ``N`` is the global count: no gather of the
    samples themselves. Computed in float32.
    """
    xt = x.float()[..., None] * t  # [N, M, T]
    sums = torch.stack([torch.cos(xt).sum(dim=0), torch.sin(xt).sum(dim=0)])  # [2, M, T]
    n = x.shape[0]
    if gather and is_distributed():
        sums = all_reduce_sum_with_grad(sums)
        n = n * get_world_size()
    cos_mean, sin_mean = sums[0] / n, sums[1] / n
    err = (cos_mean - torch.exp(-0.5 * t * t)).pow(2) + sin_mean.pow(2)  # [M, T]
    return (err @ weights) * n


def lejepa_loss(embeddings: Sequence[torch.Tensor], num_global: int, directions: torch.Tensor, t: torch.Tensor,
                weights: torch.Tensor, lambd: float = 0.05, gather: bool = True) -> dict[str, torch.Tensor]:
    r"""LeJEPA's objective (Balestriero & LeCun 2025, Algorithm 2) on the embeddings of every view ``[B, K]``,
    the first ``num_global`` being the global views:

    .. math::

        \mu_b = \frac{1}{V_g}\sum_{g \le V_g} z_{g,b}, \quad
        \mathcal{L}_{inv} = \frac{1}{V B K}\sum_{v,b,k} (\mu_{b,k} - z_{v,b,k})^2, \quad
        \mathcal{L}_{SIGReg} = \frac{1}{V M}\sum_{v, m} EP(z_v a_m)

        \mathcal{L} = (1 - \lambda)\,\mathcal{L}_{inv} + \lambda\,\mathcal{L}_{SIGReg}

    with ``directions`` ``[K, M]`` the unit vectors ``a_m`` shared by every view (:func:`epps_pulley`). No
    stop-gradient, no teacher: the gradient flows through the centre too. Returns ``loss``,
    ``invariance`` and ``sigreg``.
    """
    if not 1 <= num_global <= len(embeddings):
        raise ValueError(f"lejepa needs 1 <= num_global <= {len(embeddings)} views, got {num_global}")
    z = [e.float() for e in embeddings]
    centre = torch.stack(z[:num_global]).mean(dim=0)
    invariance = torch.stack([(centre - v).pow(2).mean() for v in z]).mean()
    sigreg = torch.stack([epps_pulley(v @ directions, t, weights, gather).mean() for v in z]).mean()
    return {"loss": (1.0 - lambd) * invariance + lambd * sigreg, "invariance": invariance, "sigreg": sigreg}


@register_loss("lejepa")
class LeJEPALoss(nn.Module):
    """LeJEPA's loss (:func:`lejepa_loss`) on ``output["projections"]``, one per view, global views first.

    Config: ``loss: {name: lejepa, num_global, lambd, num_slices, knots, t_max}``. Paper: ``lambd`` 0.05,
    2 global + 8 local views, 1024 slices ("starting points"); reference code: 17 knots on ``[0, 3]``. The
    slice directions are a schedule on the training clock (:func:`slice_directions` of ``ctx.clock.step``);
    called without a context (a bare call) the loss is at update 0. Logs ``invariance`` and ``sigreg``
    (detached).
    """

    t: torch.Tensor
    weights: torch.Tensor

    def __init__(self, num_global: int = 2, lambd: float = 0.05, num_slices: int = 1024, knots: int = 17,
                 t_max: float = 3.0, gather: bool = True) -> None:
        super().__init__()
        if num_global < 1:
            raise ValueError(f"lejepa num_global must be >= 1, got {num_global}")
        if not 0.0 <= lambd <= 1.0:
            raise ValueError(f"lejepa lambd must be in [0, 1], got {lambd}")
        if num_slices < 1:
            raise ValueError(f"lejepa num_slices must be >= 1, got {num_slices}")
        t, weights = epps_pulley_knots(knots, t_max)
        self.register_buffer("t", t, persistent=False)
        self.register_buffer("weights", weights, persistent=False)
        self.num_global, self.lambd, self.num_slices = int(num_global), float(lambd), int(num_slices)
        self.gather = gather

    def forward(self, output: Any, sample: dict[str, Any], ctx: StepContext | None = None) -> dict[str, torch.Tensor]:
        """The loss and its two terms for this step's views."""
        z = output["projections"]
        update = ctx.clock.step if ctx is not None else 0
        directions = slice_directions(z[0].shape[1], self.num_slices, update, z[0].device)
        with torch.autocast(z[0].device.type, enabled=False):
            out = lejepa_loss(z, self.num_global, directions, self.t, self.weights, self.lambd, self.gather)
        return {"loss": out["loss"], "invariance": out["invariance"].detach(), "sigreg": out["sigreg"].detach()}


#: The method object: what ``method.name=lejepa`` trains.
LEJEPA = register_method(Method(
    name="lejepa", model="ssl_model", loss="lejepa", required_hooks=(), transform="multicrop",
    summary=("LeJEPA (Balestriero & LeCun, 2025): every view predicts the mean embedding of the global views;"
             " SIGReg (Epps-Pulley on random slices) keeps the embeddings isotropic Gaussian. No teacher."),
))
