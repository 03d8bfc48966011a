"""DINO (Caron et al., 2021): self-distillation from a momentum teacher with centring and sharpening, multi-crop."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from sslkit.clock import StepContext, TrainClock
from sslkit.hooks.freeze import FreezeParametersHook
from sslkit.methods.base import Method, register_method
from sslkit.methods.center import Center
from sslkit.models.output import ModelOutput
from sslkit.models.ssl_model import SSLModel, forward_views
from sslkit.models.teacher import frozen_copy
from sslkit.optim.schedules import TeacherTemperature
from sslkit.registry import register_head, register_hook, register_loss, register_model

if TYPE_CHECKING:
    pass

__all__ = [
    "DINO",
    "DINOHead",
    "DINOLoss",
    "DINOModel",
    "FreezeLastLayerHook",
    "build_dino",
    "build_dino_head",
    "dino_cross_entropy",
    "dino_loss",
    "dino_teacher_probs",
    "dino_temperatures",
    "mean_entropy",
]


# ----------------------------------------------------------------------------------------- head
class DINOHead(nn.Module):
    """DINO's projection head (Caron et al. 2021, section 3.1 and appendix).

    ``x -> MLP -> x / |x| -> W x`` where the MLP has ``num_layers`` linear layers (``in_dim ->
    hidden_dim -> ... -> bottleneck_dim``, GELU between them, optional BatchNorm) and ``W`` is a
    bias-free, weight-normalised linear layer to ``out_dim`` "prototypes": ``W_k = g_k v_k / |v_k|``
    (Salimans & Kingma 2016). With ``norm_last_layer`` the gains ``g`` are fixed to 1 (not
    trained), so every row of ``W`` has norm 1 and the outputs are cosine similarities.

    Weight normalisation uses ``torch.nn.utils.parametrizations.weight_norm`` (the parametrised
    form; the old ``torch.nn.utils.weight_norm`` hook is deprecated): the parameters are
    ``last_layer.parametrizations.weight.original0`` (``g``, [out_dim, 1]) and ``original1``
    (``v``); they save and load with the state dict and survive ``copy.deepcopy`` (so
    ``frozen_copy`` makes a proper teacher).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int = 65536,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        num_layers: int = 3,
        batch_norm: bool = False,
        norm_last_layer: bool = True,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"dino head needs num_layers >= 1, got {num_layers}")
        layers: list[nn.Module] = []
        dim = in_dim
        for _ in range(num_layers - 1):
            layers.append(nn.Linear(dim, hidden_dim))
            if batch_norm:
                layers.append(nn.BatchNorm1d(hidden_dim))
            layers.append(nn.GELU())
            dim = hidden_dim
        layers.append(nn.Linear(dim, bottleneck_dim))
        self.mlp = nn.Sequential(*layers)
        for m in self.mlp.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.last_layer = weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        gain = self.last_layer.parametrizations.weight.original0
        with torch.no_grad():
            gain.fill_(1.0)
        gain.requires_grad_(not norm_last_layer)
        self.out_dim = out_dim
        self.norm_last_layer = norm_last_layer
        #: the constructor's arguments (iBOT and DINOv2 build a separate patch head of the same shape from them)
        self.hparams = dict(in_dim=in_dim, out_dim=out_dim, hidden_dim=hidden_dim, bottleneck_dim=bottleneck_dim,
                            num_layers=num_layers, batch_norm=batch_norm, norm_last_layer=norm_last_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Features [B, in_dim] to prototype logits [B, out_dim]."""
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))


@register_head("dino")
def build_dino_head(
    in_dim: int,
    out_dim: int = 65536,
    hidden_dim: int = 2048,
    bottleneck_dim: int = 256,
    num_layers: int = 3,
    batch_norm: bool = False,
    norm_last_layer: bool = True,
) -> DINOHead:
    """A :class:`DINOHead` (paper: 3 layers, hidden 2048, bottleneck 256, 65536 outputs, no BN)."""
    return DINOHead(in_dim, out_dim, hidden_dim, bottleneck_dim, num_layers, batch_norm, norm_last_layer)


# ---------------------------------------------------------------------------------------- model
class DINOModel(SSLModel):
    """Student (``trunk`` + ``head``) and teacher (``teacher_trunk`` + ``teacher_head``, frozen
    copies moved by the ``momentum_teacher`` hook).

    ``forward(views)`` runs the student on every crop (the global crops in one batch, the local
    crops in another, :func:`forward_views`) and the teacher, under ``no_grad``, on the first
    ``num_global`` crops only. Returns, one tensor per view: ``features`` (student trunk),
    ``projections`` (student head outputs, [B, out_dim] logits) and ``targets`` (teacher head
    outputs for the global crops).
    """

    def __init__(self, trunk: nn.Module, head: nn.Module | None = None, num_global: int = 2) -> None:
        super().__init__(trunk, head)
        if num_global < 1:
            raise ValueError(f"dino needs num_global >= 1, got {num_global}")
        self.num_global = int(num_global)
        self.teacher_trunk = frozen_copy(self.trunk)
        self.teacher_head = frozen_copy(self.head)

    def momentum_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(student, teacher) pairs for the EMA hook."""
        return [(self.trunk, self.teacher_trunk), (self.head, self.teacher_head)]

    def forward(self, views: Sequence[torch.Tensor] | torch.Tensor) -> ModelOutput:
        """Student outputs on all crops, teacher outputs on the global crops."""
        if isinstance(views, torch.Tensor):
            views = [views]
        out = super().forward(views)
        globals_ = list(views[: self.num_global])
        with torch.no_grad():
            feats = forward_views(self.teacher_trunk, globals_)
            sizes = [f.shape[0] for f in feats]
            t = self.teacher_head(torch.cat(feats) if len(feats) > 1 else feats[0])
        out.targets = list(t.split(sizes))
        return out


@register_model("dino")
def build_dino(trunk: nn.Module, head: nn.Module | None = None, num_global: int = 2) -> DINOModel:
    """DINO wiring: student trunk + head (``model.head``, use ``name: dino``) and their momentum
    teacher, which sees the first ``num_global`` crops."""
    return DINOModel(trunk, head, num_global=num_global)


# ----------------------------------------------------------------------------------------- loss
def dino_loss(
    student: Sequence[torch.Tensor],
    teacher: Sequence[torch.Tensor],
    center: torch.Tensor,
    student_temp: float = 0.1,
    teacher_temp: float = 0.04,
) -> torch.Tensor:
    """DINO's self-distillation loss (Caron et al. 2021, eq. 3 and section 3.1).

    Teacher probabilities are centred and sharpened, student probabilities only sharpened::

        P_t(x_i) = softmax((g_t(x_i) - c) / tau_t)        for the global crops i
        log P_s(x_v) = log_softmax(g_s(x_v) / tau_s)      for every crop v
        L = 1/|pairs| sum_{i} sum_{v != i} 1/B sum_b -sum_k P_t(x_i)[b, k] log P_s(x_v)[b, k]

    where ``student[v]`` [B, K] are the student logits of crop v (global crops first, so crop
    index i of the teacher and of the student name the same view), ``teacher[i]`` the teacher
    logits of global crop i, ``c`` [1, K] the centre. No gradient flows into the teacher.
    """
    if len(student) < 2 or not teacher:
        raise ValueError(f"dino needs >= 2 student crops and >= 1 teacher crop, got {len(student)}, {len(teacher)}")
    return dino_cross_entropy(student, dino_teacher_probs(teacher, center, teacher_temp), student_temp)


def dino_temperatures(student_temp: float, teacher_temp: float, warmup_teacher_temp: float,
                      warmup_steps: int = 0, warmup_epochs: float = 0.0) -> tuple[float, TeacherTemperature]:
    """The student temperature and the teacher's :class:`TeacherTemperature` of a DINO-family loss (DINO's, and
    the CLS term of iBOT's and DINOv2's), all of them checked > 0."""
    if min(student_temp, teacher_temp, warmup_teacher_temp) <= 0:
        raise ValueError("dino temperatures must be > 0")
    return float(student_temp), TeacherTemperature(teacher_temp, warmup_teacher_temp, warmup_steps, warmup_epochs)


def dino_teacher_probs(teacher: Sequence[torch.Tensor], center: torch.Tensor, teacher_temp: float) -> torch.Tensor:
    """The teacher's probabilities ``[T, B, K]``, centred and sharpened: ``softmax((g_t(x_i) - c) / tau_t)`` for each
    of the ``T`` crops' logits ``[B, K]``; detached, float32."""
    return F.softmax((torch.stack(list(teacher)).detach().float() - center) / teacher_temp, dim=-1)


def mean_entropy(probs: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The mean entropy of the distributions ``probs`` ``[..., K]`` (``ln K`` if uniform, 0 if one-hot), weighted by
    ``weight`` ``[...]`` when given (iBOT: the masked patches only); no gradient."""
    with torch.no_grad():
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)
        if weight is None:
            return entropy.mean()
        weight = weight.float()
        return (entropy * weight).sum() / weight.sum().clamp(min=1.0)


def dino_cross_entropy(student: Sequence[torch.Tensor], teacher_probs: torch.Tensor | Sequence[torch.Tensor],
                       student_temp: float = 0.1) -> torch.Tensor:
    """DINO's cross-entropy given the teacher's probabilities ``[T, B, K]`` (centred and sharpened, or Sinkhorn-Knopp's:
    DINOv2): the mean over the pairs (teacher crop i, student crop v != i) of ``1/B sum_b -sum_k P_t(x_i)[b, k] log
    softmax(g_s(x_v) / tau_s)[b, k]`` (:func:`dino_loss`)."""
    p_t = teacher_probs if isinstance(teacher_probs, torch.Tensor) else torch.stack(list(teacher_probs))
    if len(student) < 2 or p_t.shape[0] < 1:
        raise ValueError(f"dino needs >= 2 student crops and >= 1 teacher crop, got {len(student)}, {p_t.shape[0]}")
    if p_t.shape[0] > len(student):
        raise ValueError(f"dino got {p_t.shape[0]} teacher crops but only {len(student)} student crops")
    log_p_s = F.log_softmax(torch.stack(list(student)).float() / student_temp, dim=-1)  # [V, B, K]
    p_t = p_t.detach().float()
    n_t, b = p_t.shape[0], p_t.shape[1]
    # cross[i, v] = 1/B sum_b -sum_k P_t(x_i)[b, k] log P_s(x_v)[b, k]: one GEMM over (b, k)
    cross = -(p_t.reshape(n_t, -1) @ log_p_s.reshape(log_p_s.shape[0], -1).T) / b  # [T, V]
    mask = torch.ones_like(cross)
    mask[:, :n_t].fill_diagonal_(0.0)  # drop the pairs v == i (a mask, not indexing: no host sync)
    return (cross * mask).sum() / (cross.numel() - n_t)


@register_loss("dino")
class DINOLoss(nn.Module):
    """DINO loss: the centre is the loss's state, the teacher temperature a schedule on the training clock.

    Config: ``loss: {name: dino, out_dim, student_temp, teacher_temp, warmup_teacher_temp,
    warmup_teacher_temp_steps or
    warmup_teacher_temp_epochs, center_momentum}``. Reads ``output["projections"]`` (student,
    every crop) and ``output["targets"]`` (teacher, global crops) of the ``dino`` model.

    Both pieces of state run on the training clock (``ctx.clock``, :class:`~sslkit.clock.TrainClock`):

    * the teacher temperature is :func:`teacher_temp_at` of ``ctx.clock.step``, the optimizer
      updates done, so with gradient accumulation every micro-batch of an update uses the value a
      run with the whole batch uses; it is published as the scheduled value ``teacher_temp``;
    * the centre (``center``, a :class:`~sslkit.methods.center.Center` of ``[1, out_dim]``) moves once per
      optimizer update: ``c <- m c + (1 - m) mean(teacher outputs)``, the mean over every global crop of
      every micro-batch of the update on every rank, ``m = center_momentum``. Called without a context (a
      bare call), the loss is at update 0 and the centre moves at once.

    State advances only on train forwards: the module in training mode with gradients enabled
    (the stages' train phases). Returns ``loss`` and the logged term ``teacher_entropy`` (mean
    entropy of the teacher's distribution: ``ln K`` if uniform, 0 if one-hot -- the two collapses
    centring and sharpening balance).
    """

    def __init__(
        self,
        out_dim: int = 65536,
        student_temp: float = 0.1,
        teacher_temp: float = 0.07,
        warmup_teacher_temp: float = 0.04,
        warmup_teacher_temp_steps: int = 0,
        center_momentum: float = 0.9,
        warmup_teacher_temp_epochs: float = 0.0,
    ) -> None:
        super().__init__()
        self.student_temp, self.teacher_temp = dino_temperatures(student_temp, teacher_temp, warmup_teacher_temp,
                                                                 warmup_teacher_temp_steps, warmup_teacher_temp_epochs)
        self.out_dim = int(out_dim)
        self.center = Center(self.out_dim, center_momentum)

    def set_epoch_length(self, updates: int) -> None:
        """Called by the builder with the run's optimizer updates per epoch (a warm-up given in epochs)."""
        self.teacher_temp.set_epoch_length(updates)

    def forward(self, output: dict[str, Any], sample: dict[str, Any],
                ctx: StepContext | None = None) -> dict[str, torch.Tensor]:
        """The loss of this batch at ``ctx.clock.step``; on train forwards, the centre moves once per update."""
        student, teacher = output["projections"], output["targets"]
        if teacher[0].shape[-1] != self.out_dim:
            raise ValueError(f"dino loss out_dim={self.out_dim} but the head gives {teacher[0].shape[-1]}: "
                             "set loss.out_dim to model.head.out_dim")
        tau_t = self.teacher_temp.at(ctx.clock if ctx is not None else TrainClock())
        p_t = dino_teacher_probs(teacher, self.center.value, tau_t)  # once, for the loss and the logged entropy
        loss = dino_cross_entropy(student, p_t, self.student_temp)
        entropy = mean_entropy(p_t[0])
        if self.training and torch.is_grad_enabled():
            self.center.accumulate(teacher)
            if ctx is None or ctx.clock.last_micro_batch:
                self.center.update()
        if ctx is not None:
            ctx.record("teacher_temp", tau_t)
        return {"loss": loss, "teacher_entropy": entropy}


# ----------------------------------------------------------------------------------------- hook
@register_hook("dino_freeze_last_layer")
class FreezeLastLayerHook(FreezeParametersHook):
    """Keeps the head's last layer fixed during the first ``freeze_last_layer_epochs`` epochs
    (DINO: 1; it stabilises the start of training).

    The freeze of :class:`~sslkit.hooks.freeze.FreezeParametersHook` (the one mechanism, ``model.freeze``'s too) on
    every parameter of ``task.base_model.<module>``: while ``task.clock.epoch < freeze_last_layer_epochs`` their
    gradients are dropped after backward (``grad = None``, as the reference code does), so the optimizer skips
    them: no step, no Adam moments, no weight decay.
    """

    name = "dino_freeze_last_layer"
    hint = "use model.name=dino with model.head.name=dino, or set the hook's module"

    def __init__(self, freeze_last_layer_epochs: int = 1, module: str = "head.last_layer") -> None:
        if freeze_last_layer_epochs < 0:
            raise ValueError(f"freeze_last_layer_epochs must be >= 0, got {freeze_last_layer_epochs}")
        super().__init__([([f"{module}.*"], "epochs", int(freeze_last_layer_epochs))])
        self.freeze_last_layer_epochs = int(freeze_last_layer_epochs)
        self.module = module


#: The method object: what ``method.name=dino`` trains.
DINO = register_method(Method(
    name="dino", model="dino", loss="dino", required_hooks=("momentum_teacher",), transform="multicrop",
    summary="DINO (Caron et al., 2021): self-distillation from a momentum teacher with centring and sharpening.",
))
