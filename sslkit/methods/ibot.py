"""iBOT (Zhou et al., 2022): DINO on the CLS tokens plus self-distillation of the masked patches from an EMA teacher."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sslkit.clock import StepContext, TrainClock
from sslkit.methods.base import Method, register_method
from sslkit.methods.center import Center
from sslkit.methods.dino import DINOHead, dino_cross_entropy, dino_teacher_probs, dino_temperatures, mean_entropy
from sslkit.methods.dinov2_parts import gather_slots, masked_patch_loss, masked_slots
from sslkit.models.masking import Masks, crops_mask
from sslkit.models.output import ModelOutput
from sslkit.models.ssl_model import SSLModel, encode_views
from sslkit.models.teacher import frozen_copy
from sslkit.models.tokens import Tokens, TokenTrunk
from sslkit.optim.schedules import TeacherTemperature
from sslkit.registry import register_loss, register_model

__all__ = ["IBOT", "CenteredTeacher", "GlobalCrops", "IBOTLoss", "IBOTModel", "build_ibot"]


class GlobalCrops(NamedTuple):
    """What :class:`IBOTModel` computed on the ``G`` global crops of a batch, all crops in one batch of ``G x B``."""

    #: the global crops ``[G B, C, H, W]``, crop after crop
    images: torch.Tensor
    #: ``[G B, N]`` True where the student saw the mask token
    mask: torch.Tensor
    #: the student's tokens of the masked crops (with gradient)
    student: Tokens
    #: the EMA teacher's tokens of the whole crops (no gradient)
    teacher: Tokens


class IBOTModel(SSLModel):
    """iBOT's (and DINOv2's) student and EMA teacher over a ViT with a mask token.

    ``forward(views, masks)``: the student sees the ``num_global`` global crops with their masked patches
    replaced by the mask token (one forward for all of them) and the local crops whole; the teacher, under
    ``no_grad``, sees the global crops whole. Outputs, per view: ``features`` (the student trunk's pooled tokens),
    ``projections`` (the CLS head's logits); per global crop: ``targets`` (the teacher's CLS logits); for all
    global crops together (one-element lists): ``patch_projections`` / ``patch_targets`` (the student's and
    teacher's patch-head logits ``[S, K]`` at the masked patches of the ``G x B`` crops, gathered into ``S``
    fixed places, :func:`~sslkit.models.masking.batch_slots`: only masked patches go through the patch head, as DINOv2
    does, without a host-side index), ``patch_weights`` ``[S]`` (1 on a masked patch, 0 on padding) and
    ``patch_images`` ``[S]`` (the crop each place belongs to, ``g x B + b``).

    The patch head is the CLS head itself (``separate_patch_head=False``: iBOT's ``shared_head``, DINOv2's
    default) or a second head of the same shape with ``patch_out_dim`` outputs. ``model.trunk`` is the student
    trunk every evaluation reads.
    """

    trunk: TokenTrunk
    head: DINOHead

    def __init__(self, trunk: nn.Module, head: nn.Module, num_global: int = 2, separate_patch_head: bool = False,
                 patch_out_dim: int | None = None) -> None:
        if not isinstance(trunk, TokenTrunk):
            raise ValueError("ibot and dinov2 need a ViT trunk (model.trunk=vit_tiny, vit_small, ...)")
        if not isinstance(head, DINOHead):
            raise ValueError("ibot and dinov2 need a DINO head: model.head.name=dino")
        if num_global < 1:
            raise ValueError(f"model.kwargs.num_global must be >= 1, got {num_global}")
        trunk.enable_mask_token()
        super().__init__(trunk, head)
        self.num_global = int(num_global)
        self.patch_head: DINOHead | None = None
        if separate_patch_head:
            self.patch_head = DINOHead(**{**head.hparams, "out_dim": int(patch_out_dim or head.out_dim)})
        elif patch_out_dim is not None and int(patch_out_dim) != head.out_dim:
            raise ValueError(f"model.kwargs.patch_out_dim={patch_out_dim} differs from model.head.out_dim="
                             f"{head.out_dim}: a shared head has one output size (set separate_patch_head=true)")
        self.teacher_trunk: TokenTrunk = frozen_copy(trunk)
        self.teacher_head = frozen_copy(head)
        self.teacher_patch_head = frozen_copy(self.patch_head) if self.patch_head is not None else None

    @property
    def patch_out_dim(self) -> int:
        """The patch head's number of outputs."""
        return int((self.patch_head or self.head).out_dim)

    def momentum_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(student, teacher) pairs for the EMA hook."""
        pairs = [(self.trunk, self.teacher_trunk), (self.head, self.teacher_head)]
        if self.patch_head is not None and self.teacher_patch_head is not None:  # made together
            pairs.append((self.patch_head, self.teacher_patch_head))
        return pairs

    def forward(self, views: Sequence[torch.Tensor] | torch.Tensor,
                masks: Sequence[Masks | None] | None = None) -> ModelOutput:
        """Student on every crop (global crops masked), teacher on the global crops."""
        return self.forward_globals(views, masks)[0]

    def forward_globals(self, views: Sequence[torch.Tensor] | torch.Tensor,
                        masks: Sequence[Masks | None] | None = None) -> tuple[ModelOutput, GlobalCrops]:
        """:meth:`forward`'s output and what it computed on the global crops (:class:`GlobalCrops`), for a method
        that reads more of them (DINOv3's Gram anchoring reads every patch token of the student and teacher)."""
        if isinstance(views, torch.Tensor):
            views = [views]
        views = list(views)
        g = self.num_global
        if len(views) < g:
            raise ValueError(f"ibot needs {g} global crops (model.kwargs.num_global), got {len(views)} views")
        given = list(masks) if masks is not None else []
        given += [None] * (len(views) - len(given))
        globals_ = torch.cat(views[:g]) if g > 1 else views[0]
        h, w = self.trunk.grid(globals_.shape[-2], globals_.shape[-1])
        n = h * w
        mask, slots = crops_mask(views[:g], given[:g], n)
        student = self.trunk.forward_tokens(globals_, mask=mask)
        features = list(self.trunk.pool_tokens(student).chunk(g))
        if len(views) > g:
            features += encode_views(self.trunk, views[g:])[0]
        projections = self.head(torch.cat(features)).split([f.shape[0] for f in features])
        patch_head = self.patch_head or self.head
        # the same S places of the batch's masked patches for the student and the teacher
        index, weight = masked_slots(mask.reshape(1, -1), slots)  # [1, S]
        s_logits = patch_head(gather_slots(student.patches.flatten(0, 1)[None], index)[0])  # [S, K]
        with torch.no_grad():
            teacher = self.teacher_trunk.forward_tokens(globals_)
            targets = self.teacher_head(self.teacher_trunk.pool_tokens(teacher)).chunk(g)
            t_patches = gather_slots(teacher.patches.flatten(0, 1)[None], index)[0]
            t_logits = (self.teacher_patch_head or self.teacher_head)(t_patches)
        output = ModelOutput(features=features, projections=list(projections), targets=list(targets),
                             masks=given[:g], patch_projections=[s_logits], patch_targets=[t_logits],
                             patch_weights=[weight[0]], patch_images=[index[0] // n])
        return output, GlobalCrops(globals_, mask, student, teacher)


@register_model("ibot")
def build_ibot(trunk: nn.Module, head: nn.Module | None = None, num_global: int = 2,
               separate_patch_head: bool = False, patch_out_dim: int | None = None) -> IBOTModel:
    """iBOT / DINOv2 wiring: a ViT student (with a mask token), the DINO head (``model.head.name=dino``), optionally
    a separate patch head (``model.kwargs``: separate_patch_head, patch_out_dim), and their EMA teacher."""
    if head is None:
        raise ValueError("ibot and dinov2 need a DINO head: model.head.name=dino")
    return IBOTModel(trunk, head, num_global, separate_patch_head, patch_out_dim)


class CenteredTeacher:
    """The teacher-probability rule of DINO and iBOT: the teacher's logits minus a centre that moves once per
    update with the batches' mean, sharpened by the temperature (softmax). Holds the loss's two centres (CLS and
    patches, :class:`~sslkit.methods.center.Center`) without owning them: their state is the loss's."""

    def __init__(self, cls: Center, patches: Center) -> None:
        self.cls_center, self.patch_center = cls, patches

    def cls_probs(self, logits: Sequence[torch.Tensor], temp: float) -> torch.Tensor:
        """``[G, B, K]``: each global crop's CLS logits centred and sharpened."""
        return dino_teacher_probs(logits, self.cls_center.value, temp)

    def patch_probs(self, logits: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                    temp: float) -> list[torch.Tensor]:
        """The masked-patch slots' logits (``[B, M, K]`` per global crop, or ``[S, K]`` for them all) centred by the
        patch centre and sharpened."""
        return [F.softmax((t.detach().float() - self.patch_center.value) / temp, dim=-1) for t in logits]

    def after_train_forward(self, output: Any, ctx: StepContext | None) -> None:
        """Add this micro-batch's teacher logits to both centres' sums; move the centres on an update's last one."""
        self.cls_center.accumulate(output["targets"])
        self.patch_center.accumulate(output["patch_targets"], output["patch_weights"])
        if ctx is None or ctx.clock.last_micro_batch:
            self.cls_center.update()
            self.patch_center.update()


@register_loss("ibot")
class IBOTLoss(nn.Module):
    """iBOT's loss (Zhou et al. 2022, section 3.2): ``lambda_cls`` times DINO's loss on the CLS tokens
    (:func:`~sslkit.methods.dino.dino_cross_entropy` against the teacher centred by ``cls_center`` and sharpened by
    DINO's temperature and warm-up) plus ``lambda_patch`` times the
    masked-patch loss (:func:`~sslkit.methods.dinov2_parts.masked_patch_loss`), each global crop's student patches
    against the teacher's patches of the same crop, centred by their own centre (``patch_center``) and sharpened by the
    patch teacher temperature (warm-up ``warmup_teacher_patch_temp`` -> ``teacher_patch_temp`` over
    ``warmup_teacher_temp_steps`` updates, or ``warmup_teacher_temp_epochs`` epochs), averaged over the global crops.

    Logged: ``cls_loss``, ``patch_loss``, ``teacher_entropy`` (CLS) and ``teacher_patch_entropy`` (the mean
    entropy of the teacher's distribution over the masked patches: ``ln K`` if uniform).
    """

    def __init__(self, out_dim: int = 8192, patch_out_dim: int | None = None, student_temp: float = 0.1,
                 teacher_temp: float = 0.07, warmup_teacher_temp: float = 0.04, warmup_teacher_temp_steps: int = 0,
                 teacher_patch_temp: float = 0.07, warmup_teacher_patch_temp: float = 0.04,
                 center_momentum: float = 0.9, lambda_cls: float = 1.0, lambda_patch: float = 1.0,
                 warmup_teacher_temp_epochs: float = 0.0) -> None:
        super().__init__()
        if min(teacher_patch_temp, warmup_teacher_patch_temp) <= 0:
            raise ValueError("ibot patch temperatures must be > 0")
        self.out_dim, self.patch_out_dim = int(out_dim), int(patch_out_dim or out_dim)
        #: the CLS teacher temperature; the patch one warms up over the same updates
        self.student_temp, self.teacher_temp = dino_temperatures(student_temp, teacher_temp, warmup_teacher_temp,
                                                                 warmup_teacher_temp_steps, warmup_teacher_temp_epochs)
        self.teacher_patch_temp = TeacherTemperature(teacher_patch_temp, warmup_teacher_patch_temp,
                                                     warmup_teacher_temp_steps, warmup_teacher_temp_epochs)
        self.cls_center = Center(self.out_dim, center_momentum)
        self.patch_center = Center(self.patch_out_dim, center_momentum)
        self.lambda_cls, self.lambda_patch = float(lambda_cls), float(lambda_patch)
        #: how the teacher's logits become targets (:class:`CenteredTeacher`; DINOv2 may pick Sinkhorn-Knopp)
        self.teacher_rule: CenteredTeacher | Any = CenteredTeacher(self.cls_center, self.patch_center)

    def set_epoch_length(self, updates: int) -> None:
        """Called by the builder with the run's updates per epoch: a warm-up in epochs becomes updates (both
        temperatures)."""
        self.teacher_temp.set_epoch_length(updates)
        self.teacher_patch_temp.set_epoch_length(updates)

    def forward(self, output: Any, sample: dict[str, Any], ctx: StepContext | None = None) -> dict[str, torch.Tensor]:
        """The weighted sum of the CLS and patch losses of this batch; on train forwards the centres move once per
        update."""
        student, teacher = output["projections"], output["targets"]
        s, t, w = output["patch_projections"], output["patch_targets"], output["patch_weights"]
        if teacher[0].shape[-1] != self.out_dim:
            raise ValueError(f"{type(self).__name__}: loss.out_dim={self.out_dim} but the head gives "
                             f"{teacher[0].shape[-1]}: set loss.out_dim to model.head.out_dim")
        if t[0].shape[-1] != self.patch_out_dim:
            raise ValueError(f"{type(self).__name__}: loss.patch_out_dim={self.patch_out_dim} but the patch head "
                             f"gives {t[0].shape[-1]}: set loss.patch_out_dim to the patch head's out_dim")
        clock = ctx.clock if ctx is not None else TrainClock()
        temp, patch_temp = self.teacher_temp.at(clock), self.teacher_patch_temp.at(clock)
        cls_probs = self.teacher_rule.cls_probs(teacher, temp)
        cls_loss = dino_cross_entropy(student, cls_probs, self.student_temp)
        probs = self.teacher_rule.patch_probs(t, w, patch_temp)
        images = output["patch_images"] if "patch_images" in output else [None] * len(s)
        patch = torch.stack([masked_patch_loss(si, pi, wi, self.student_temp, im, len(student[0]) * len(teacher))
                             for si, pi, wi, im in zip(s, probs, w, images)]).mean()
        entropy, patch_entropy = mean_entropy(cls_probs[0]), mean_entropy(torch.stack(probs), torch.stack(list(w)))
        if self.training and torch.is_grad_enabled():
            self.teacher_rule.after_train_forward(output, ctx)
        if ctx is not None:
            ctx.record("teacher_temp", temp)
            ctx.record("teacher_patch_temp", patch_temp)
        loss = self.lambda_cls * cls_loss + self.lambda_patch * patch
        return {"loss": loss, "cls_loss": cls_loss.detach(), "patch_loss": patch.detach(),
                "teacher_entropy": entropy, "teacher_patch_entropy": patch_entropy}


#: The method object: what ``method.name=ibot`` trains.
IBOT = register_method(Method(
    name="ibot", model="ibot", loss="ibot", required_hooks=("momentum_teacher",), transform="multicrop",
    masking="block", patch_tokens=True,
    summary="iBOT (Zhou et al., 2022): DINO on the CLS token plus distillation of masked patches from an EMA teacher.",
))
