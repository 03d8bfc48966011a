"""DINOv3 (Siméoni et al., 2025): DINOv2's losses plus Gram anchoring of the patch features to a Gram teacher.

One file of composition on the DINOv2 parts: :class:`DINOv3Model` is iBOT's wiring (student, EMA teacher, masked
global crops) plus a Gram teacher, a frozen snapshot of the EMA teacher that the model owns (so the checkpoint,
sharded or not, holds it); :class:`DINOv3Loss` is DINOv2's loss plus the Gram loss
(:func:`~sslkit.methods.gram.gram_loss`) with its weight on the training clock; :class:`GramTeacherHook` decides
when the Gram teacher is a fresh snapshot (:func:`~sslkit.methods.gram.gram_snapshot_at`). The reference is
facebookresearch/dinov3 ``train/ssl_meta_arch.py`` (``get_gram_teacher_output``, ``update_gram``,
``gram_load_ema_teacher``) and ``train/train.py`` (when the Gram teacher is refreshed).

A recipe sets the Gram settings under ``gram.*`` (sslkit/config/defaults.yaml) and routes them to the model
(``model.kwargs.gram_teacher``), the loss (``loss.gram_*``) and the hook (``method.hooks.gram_teacher``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sslkit.clock import StepContext, TrainClock
from sslkit.errors import UserError
from sslkit.hooks.base import SSLHook, method_model
from sslkit.methods.anchor import ANCHOR_METRICS, anchor_loss, anchor_rule
from sslkit.methods.base import Method, RunShape, register_method
from sslkit.methods.dinov2 import DINOv2Loss, sinkhorn_batch_rule
from sslkit.methods.gram import (
    GRAM_NEGATIVES,
    GRAM_TOKENS,
    gram_loss,
    gram_snapshot_at,
    gram_token_weights,
    resize_patch_grid,
)
from sslkit.methods.ibot import IBOTModel
from sslkit.models.masking import Masks
from sslkit.models.output import ModelOutput
from sslkit.models.teacher import frozen_copy
from sslkit.models.weights import load_trunk
from sslkit.optim.schedules import WarmupCosine
from sslkit.registry import register_hook, register_loss, register_model

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["DINOV3", "GRAM_TEACHERS", "DINOv3Loss", "DINOv3Model", "GramError", "GramTeacherHook", "build_dinov3",
           "gram_rule"]

logger = logging.getLogger("sslkit")

#: Where the Gram teacher comes from (``gram.teacher``): ``snapshot``, a copy of the EMA teacher taken before
#: ``gram.start_step`` (and refreshed every ``gram.every`` updates); ``file``, backbone weights read from
#: ``gram.checkpoint`` (an sslkit checkpoint's EMA teacher, or released DINOv2/DINOv3 weights), refreshed from the
#: EMA teacher as ``snapshot``; ``ema``, the EMA teacher itself (DINOv3's ``gram.ema_teacher``: no second network).
GRAM_TEACHERS = ("snapshot", "file", "ema")


class GramError(UserError, ValueError):
    """Gram settings that cannot run: the message names the ``gram.*`` key and what would work."""


class DINOv3Model(IBOTModel):
    """DINOv3's student, EMA teacher and Gram teacher over a ViT with a mask token.

    :class:`~sslkit.methods.ibot.IBOTModel`'s forward (student on every crop, global crops masked; teacher on the
    global crops), plus, once the Gram loss is on (:attr:`gram_active`, set by :class:`GramTeacherHook` from the
    clock), the fields :class:`DINOv3Loss` reads: ``gram_patches`` (the student's patch tokens of the masked
    global crops, after the final norm: DINOv3's ``x_norm_patchtokens``), ``gram_targets`` (the Gram teacher's of
    the whole crops, no gradient) and ``gram_masks``. ``gram_teacher`` (:data:`GRAM_TEACHERS`): with ``snapshot``
    or ``file`` the model holds ``gram_trunk``, a frozen copy of the trunk (no gradients, outside the optimizer,
    no stochastic layer) that only :meth:`refresh_gram_teacher` and a checkpoint change; with ``ema`` the targets
    are the EMA teacher's own patch tokens.
    """

    def __init__(self, trunk: nn.Module, head: nn.Module, num_global: int = 2, separate_patch_head: bool = False,
                 patch_out_dim: int | None = None, gram_teacher: str = "snapshot", anchor: bool = False) -> None:
        if gram_teacher not in GRAM_TEACHERS:
            raise GramError(f"gram.teacher={gram_teacher!r}: use one of {', '.join(GRAM_TEACHERS)}")
        super().__init__(trunk, head, num_global, separate_patch_head, patch_out_dim)
        self.gram_teacher = gram_teacher
        self.gram_trunk = frozen_copy(self.trunk) if gram_teacher != "ema" else None
        #: the starting trunk, frozen (``anchor``): loaded with model.pretrained as every trunk copy, never changed
        self.anchor_trunk = frozen_copy(self.trunk) if anchor else None
        #: the Gram loss is on (from ``gram.start_step``): a Python flag the hook sets, so no step reads a tensor
        self.gram_active = False

    def trunk_copies(self) -> list[nn.Module]:
        """The EMA teacher's trunk, the Gram teacher's and the anchor's."""
        return super().trunk_copies() + [t for t in (self.gram_trunk, self.anchor_trunk) if t is not None]

    @torch.no_grad()
    def refresh_gram_teacher(self) -> None:
        """The Gram teacher becomes a copy of the EMA teacher's trunk (parameters and buffers; DINOv3's
        ``update_gram`` with ``m = 0``), shard by shard under FSDP2 (both are sharded alike)."""
        if self.gram_trunk is None:
            return
        for target, source in ((self.gram_trunk.parameters(), self.teacher_trunk.parameters()),
                               (self.gram_trunk.buffers(), self.teacher_trunk.buffers())):
            for t, s in zip(target, source, strict=True):
                t.copy_(s)

    def forward(self, views: Sequence[torch.Tensor] | torch.Tensor, masks: Sequence[Masks | None] | None = None,
                teacher_views: Sequence[torch.Tensor] | None = None) -> ModelOutput:
        """iBOT's outputs, the anchor's fields (``anchor_tokens``, ``anchor_targets``: the student's CLS and patch
        tokens of the masked global crops and the frozen starting trunk's of the same) when it holds one, and the
        Gram fields while :attr:`gram_active`. ``teacher_views``: the global crops at
        the Gram teacher's resolution (``gram.teacher_size``; the sample's ``teacher_input``), whose patch features
        are resized to the student's grid (bicubic, :func:`~sslkit.methods.gram.resize_patch_grid`: DINOv3's
        ``get_gram_teacher_output``); without them the Gram teacher sees the student's global crops."""
        output, crops = self.forward_globals(views, masks)
        if self.anchor_trunk is not None:  # the starting trunk on the same crops and masks as the student
            with torch.no_grad():
                start = self.anchor_trunk.forward_tokens(crops.images, mask=crops.mask)
            output.anchor_tokens = (crops.student.cls, crops.student.patches)
            output.anchor_targets = (start.cls.detach(), start.patches.detach())
        if not self.gram_active:
            return output
        if self.gram_trunk is None:
            targets = crops.teacher.patches
        else:
            with torch.no_grad():
                targets = self._gram_targets(crops.images, teacher_views)
        output.gram_patches = crops.student.patches
        output.gram_targets = targets.detach()
        output.gram_masks = crops.mask
        return output

    def _gram_targets(self, images: torch.Tensor, teacher_views: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """The Gram teacher's patch tokens of the global crops ``images``, or of ``teacher_views`` brought to the
        grid of ``images``."""
        if teacher_views is None:
            return self.gram_trunk.forward_tokens(images).patches
        high = torch.cat(list(teacher_views)) if len(teacher_views) > 1 else teacher_views[0]
        if high.shape[0] != images.shape[0]:
            raise ValueError(f"{high.shape[0]} teacher crops for {images.shape[0]} global crops: the transform gives "
                             "one teacher crop per global crop")
        patches = self.gram_trunk.forward_tokens(high).patches
        return resize_patch_grid(patches, self.trunk.grid(high.shape[-2], high.shape[-1]),
                                 self.trunk.grid(images.shape[-2], images.shape[-1]))


@register_model("dinov3")
def build_dinov3(trunk: nn.Module, head: nn.Module | None = None, num_global: int = 2,
                 separate_patch_head: bool = False, patch_out_dim: int | None = None,
                 gram_teacher: str = "snapshot", anchor: bool = False) -> DINOv3Model:
    """DINOv3 wiring: a ViT student (with a mask token), the DINO head (``model.head.name=dino``), optionally a
    separate patch head, their EMA teacher, the Gram teacher (``gram_teacher``, from ``gram.teacher``) and the
    frozen starting trunk of the anchor loss (``anchor``, :mod:`sslkit.methods.anchor`)."""
    if head is None:
        raise ValueError("dinov3 needs a DINO head: model.head.name=dino")
    return DINOv3Model(trunk, head, num_global, separate_patch_head, patch_out_dim, gram_teacher, anchor)


@register_loss("dinov3")
class DINOv3Loss(DINOv2Loss):
    """DINOv3's loss (Siméoni et al. 2025, sections 3-4; facebookresearch/dinov3 ``ssl_meta_arch.py``)::

        L = L_DINOv2 + w_gram(t) L_Gram

    ``L_DINOv2`` is :class:`~sslkit.methods.dinov2.DINOv2Loss` (DINO on the CLS tokens, iBOT on the masked
    patches, KoLeo). ``L_Gram`` (:func:`~sslkit.methods.gram.gram_loss`) is added on the steps whose output holds
    the Gram fields (:class:`DINOv3Model` from ``gram_start_step`` on): the mean squared difference of the
    student's and the Gram teacher's patch Gram matrices, over ``gram_tokens`` (:data:`~sslkit.methods.gram.
    GRAM_TOKENS`), per image (``gram_image_level``) or over the local batch, of the L2-normalised features
    (``gram_normalize``), negatives treated by ``gram_negatives`` (:data:`~sslkit.methods.gram.GRAM_NEGATIVES`).
    With ``anchor_weight`` > 0 (and the model's frozen starting trunk), ``+ anchor_weight L_anchor``
    (:func:`~sslkit.methods.anchor.anchor_loss`, ``anchor_metric``; logged ``anchor_loss``): sslkit's, not DINOv3's.
    ``w_gram`` is ``gram_weight`` from ``gram_start_step``, reached by a half cosine from 0 over
    ``gram_ramp_steps`` updates (DINOv3's ViT-7B Gram stage: 0 until the stage, then up to 2.0 over 1,000
    updates, its ``loss_weight_schedule``); 0 before. Logged: ``gram_loss`` (on the steps with it) and the
    weight ``gram_weight``.
    """

    def __init__(self, out_dim: int = 65536, patch_out_dim: int | None = None, student_temp: float = 0.1,
                 teacher_temp: float = 0.07, warmup_teacher_temp: float = 0.04, warmup_teacher_temp_steps: int = 0,
                 teacher_patch_temp: float | None = None, warmup_teacher_patch_temp: float | None = None,
                 center_momentum: float = 0.9, centering: str = "centering", sinkhorn_iterations: int = 3,
                 dino_weight: float = 1.0, ibot_weight: float = 1.0, koleo_weight: float = 0.1,
                 koleo_global: bool = True, warmup_teacher_temp_epochs: float = 0.0, gram_weight: float = 1.0,
                 gram_start_step: int = 0, gram_ramp_steps: int = 0, gram_tokens: str = "all",
                 gram_image_level: bool = True, gram_normalize: bool = True, gram_negatives: str = "keep",
                 anchor_weight: float = 0.0, anchor_metric: str = "cosine") -> None:
        super().__init__(out_dim, patch_out_dim, student_temp, teacher_temp, warmup_teacher_temp,
                         warmup_teacher_temp_steps, teacher_patch_temp, warmup_teacher_patch_temp, center_momentum,
                         centering, sinkhorn_iterations, dino_weight, ibot_weight, koleo_weight, koleo_global,
                         warmup_teacher_temp_epochs)
        if gram_tokens not in GRAM_TOKENS:
            raise GramError(f"gram.tokens={gram_tokens!r}: use one of {', '.join(GRAM_TOKENS)}")
        if gram_negatives not in GRAM_NEGATIVES:
            raise GramError(f"gram.negatives={gram_negatives!r}: use one of {', '.join(GRAM_NEGATIVES)}")
        if gram_tokens != "all" and gram_image_level:
            raise GramError(f"gram.tokens={gram_tokens} selects patches across the images of a batch: it needs "
                            "gram.image_level=false (the batch-level Gram matrix, as DINOv3's)")
        self.gram_weight = WarmupCosine(0.0, 0.0, gram_weight, 0, gram_ramp_steps, offset=gram_start_step)
        self.gram_tokens, self.gram_image_level = gram_tokens, bool(gram_image_level)
        self.gram_normalize, self.gram_negatives = bool(gram_normalize), gram_negatives
        if anchor_metric not in ANCHOR_METRICS:
            raise ValueError(f"loss.anchor_metric={anchor_metric!r}: use one of {', '.join(ANCHOR_METRICS)}")
        self.anchor_weight, self.anchor_metric = float(anchor_weight), anchor_metric

    def forward(self, output: Any, sample: dict[str, Any], ctx: StepContext | None = None) -> dict[str, torch.Tensor]:
        """DINOv2's loss, plus the weighted anchor and Gram losses when the output carries their fields."""
        out = super().forward(output, sample, ctx)
        if "anchor_tokens" in output:
            anchor = anchor_loss(*output["anchor_tokens"], *output["anchor_targets"], self.anchor_metric)
            out["loss"] = out["loss"] + self.anchor_weight * anchor
            out["anchor_loss"] = anchor.detach()
        weight = self.gram_weight.at(ctx.clock if ctx is not None else TrainClock())
        if ctx is not None:
            ctx.record("gram_weight", weight)
        if "gram_patches" not in output:
            return out
        selected = gram_token_weights(output["gram_masks"], self.gram_tokens)
        gram = gram_loss(output["gram_patches"], output["gram_targets"], normalize=self.gram_normalize,
                         image_level=self.gram_image_level, negatives=self.gram_negatives, weights=selected)
        out["loss"] = out["loss"] + weight * gram
        out["gram_loss"] = gram.detach()
        return out


@register_hook("gram_teacher")
class GramTeacherHook(SSLHook):
    """When the Gram teacher changes: a snapshot of the EMA teacher before update ``start_step`` and every
    ``every`` updates after it (0: never again), at most ``max_refreshes`` times after the first
    (:func:`~sslkit.methods.gram.gram_snapshot_at`; DINOv3's ``it_load_ema_teacher``, ``update_frequency`` and
    ``max_steps``); with ``teacher=file`` the first Gram teacher is read from ``checkpoint`` when the run starts
    and the refreshes follow; with ``teacher=ema`` nothing is copied. From ``start_step`` on the model gives the
    Gram fields (:attr:`DINOv3Model.gram_active`).

    A snapshot for update ``u`` is taken after step ``u - 1`` is done (its EMA update included), before the
    checkpoint of that step is written, so a run resumed from any checkpoint has the Gram teacher the run had.
    The hook's state is the last clock value it handled and the updates it took snapshots before (logged).
    """

    name = "gram_teacher"

    def __init__(self, start_step: int = 0, every: int = 0, max_refreshes: int | None = None,
                 teacher: str = "snapshot", checkpoint: str | None = None) -> None:
        self.start, self.every, self.max_refreshes = int(start_step), int(every), max_refreshes
        self.teacher, self.checkpoint = teacher, checkpoint
        #: the last clock value (``clock.step``) whose snapshot was decided; -1 before the run's first
        self.handled = -1
        #: the updates before which the Gram teacher became a snapshot (``-1``: read from ``checkpoint``)
        self.snapshots: list[int] = []

    def on_start(self, task: SSLTask) -> None:
        """Check the start against the run's length; on a fresh run read the file; handle the clock as it is now
        (a resumed run whose snapshot was not written yet takes it here)."""
        model = self._model(task)
        clock = task.clock
        if self.start >= clock.max_steps:
            raise GramError(f"gram.start_step={self.start} is after the run's last update ({clock.max_steps} "
                            f"updates: updates 0 to {clock.max_steps - 1}): the Gram loss would never run. Lower "
                            "gram.start_step or lengthen the run (optim.epochs, optim.max_steps)")
        if clock.step == 0 and self.handled < 0 and self.teacher == "file" and model.gram_trunk is not None:
            load_trunk(model.gram_trunk, str(self.checkpoint), "gram.checkpoint")
            self.snapshots.append(-1)
            logger.info("gram_teacher: the Gram teacher read from gram.checkpoint=%s", self.checkpoint)
        self._advance(model, clock.step)

    def on_step(self, task: SSLTask) -> None:
        """After a train step (its EMA update done): the snapshot due before the next update, if one is."""
        clock = task.clock
        if task.train and clock.step < clock.max_steps:  # no snapshot after the last update
            self._advance(self._model(task), clock.step)

    def _advance(self, model: DINOv3Model, update: int) -> None:
        """The clock reads ``update`` (the next update to run): the Gram loss is on from the start; the snapshot due
        before ``update`` is taken, once."""
        model.gram_active = update >= self.start
        if update <= self.handled:
            return
        self.handled = update
        if model.gram_trunk is None or not gram_snapshot_at(update, self.start, self.every, self.max_refreshes):
            return
        if self.teacher == "file" and update == self.start:
            return  # the file is the first Gram teacher
        model.refresh_gram_teacher()
        self.snapshots.append(update)
        logger.info("gram_teacher: the Gram teacher is the EMA teacher as it is before update %d", update)

    @staticmethod
    def _model(task: SSLTask) -> DINOv3Model:
        return method_model(task, DINOv3Model, "gram_teacher", "dinov3", GramError)

    def state_dict(self) -> dict[str, Any]:
        """The clock value handled last and the snapshots taken (the Gram teacher itself is in the model's state)."""
        return {"handled": self.handled, "snapshots": list(self.snapshots)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.handled, self.snapshots = int(state["handled"]), list(state["snapshots"])


def gram_rule(shape: RunShape) -> list[str]:
    """The Gram settings as the recipe routed them (``gram.*`` -> ``model.kwargs.gram_teacher``, ``loss.gram_*``,
    ``method.hooks.gram_teacher``): a known teacher with a source, a start inside the run (when its length is
    known here), refreshes that have something to refresh, one start for the loss and the hook."""
    hook = shape.hooks.get("gram_teacher") or {}
    teacher = shape.model_kwargs.get("gram_teacher", "snapshot")
    start = hook.get("start_step", 0)
    errors = []
    if teacher not in GRAM_TEACHERS:
        errors.append(f"'gram.teacher' = {teacher}: use one of {', '.join(GRAM_TEACHERS)}")
    if hook.get("teacher", teacher) != teacher:
        errors.append(f"'method.hooks.gram_teacher.teacher' = {hook.get('teacher')} but 'model.kwargs.gram_teacher' "
                      f"= {teacher}: route both from gram.teacher")
    checkpoint = hook.get("checkpoint")
    if teacher == "file" and not checkpoint:
        errors.append("'gram.teacher' = file: a Gram teacher without a source. Set gram.checkpoint=PATH (an sslkit "
                      "checkpoint or released DINOv2/DINOv3 weights), or gram.teacher=snapshot (the EMA teacher "
                      "copied at gram.start_step)")
    elif checkpoint and teacher != "file":
        errors.append(f"'gram.checkpoint' = {checkpoint} is read with gram.teacher=file only (now {teacher}): set "
                      "gram.teacher=file or drop gram.checkpoint")
    elif checkpoint and not Path(str(checkpoint)).expanduser().is_file():
        errors.append(f"'gram.checkpoint' = {checkpoint}: no such file; give an sslkit checkpoint file or a .pth / "
                      ".safetensors file of backbone weights")
    if teacher == "ema" and hook.get("every", 0):
        errors.append("'gram.every' > 0 with gram.teacher=ema: the EMA teacher is never a snapshot, there is nothing "
                      "to refresh; set gram.every=0 or gram.teacher=snapshot")
    if not isinstance(start, int) or start < 0:
        errors.append(f"'gram.start_step' must be an update number >= 0, got {start!r}")
    elif shape.steps is not None and start >= shape.steps:
        errors.append(f"'gram.start_step' = {start} is after the run's end: it makes {shape.steps} steps (0 to "
                      f"{shape.steps - 1}), so the Gram loss would never run. Lower gram.start_step (below "
                      f"{shape.steps}) or lengthen the run (optim.epochs, optim.max_steps)")
    if shape.loss.get("gram_start_step", start) != start:
        errors.append(f"'loss.gram_start_step' = {shape.loss['gram_start_step']} but "
                      f"'method.hooks.gram_teacher.start_step' = {start}: route both from gram.start_step")
    tokens, negatives = shape.loss.get("gram_tokens", "all"), shape.loss.get("gram_negatives", "keep")
    if tokens not in GRAM_TOKENS:
        errors.append(f"'gram.tokens' = {tokens}: use one of {', '.join(GRAM_TOKENS)}")
    elif tokens != "all" and shape.loss.get("gram_image_level", True):
        errors.append(f"'gram.tokens' = {tokens} selects patches across the images of a batch: set "
                      "gram.image_level=false (the batch-level Gram matrix, as DINOv3's) or gram.tokens=all")
    if negatives not in GRAM_NEGATIVES:
        errors.append(f"'gram.negatives' = {negatives}: use one of {', '.join(GRAM_NEGATIVES)}")
    return errors


def teacher_crops_rule(shape: RunShape) -> list[str]:
    """``gram.teacher_size`` (and a high-resolution phase's ``hires.teacher_sizes``) give the Gram teacher crops of
    its own: that needs a Gram teacher that is a second network (not ``gram.teacher=ema``, which sees the
    student's crops), and the multicrop transform, which makes those crops, told their size
    (``data.transform.teacher_size`` following ``gram.teacher_size``)."""
    gram, hires = shape.sections.get("gram", {}), shape.hires
    size = gram.get("teacher_size")
    phase = [t for t in hires.get("teacher_sizes") or [] if t is not None] if hires.get("start_step") is not None \
        else []
    if size is None and not phase:
        return []
    key = "gram.teacher_size" if size is not None else "hires.teacher_sizes"
    errors = []
    if gram.get("teacher") == "ema":
        errors.append(f"'{key}' gives the Gram teacher crops of its own, and gram.teacher=ema has no Gram teacher "
                      "network (the EMA teacher sees the student's crops): set gram.teacher=snapshot or file, or "
                      f"drop {key}")
    if shape.transform.get("teacher_size") != size:
        errors.append(f"'{key}' is set, but data.transform.teacher_size does not follow gram.teacher_size (the "
                      "multicrop transform makes the teacher's crops): set data.transform.teacher_size="
                      "${gram.teacher_size}, as the dinov3 recipes do")
    return errors


#: The method object: what ``method.name=dinov3`` trains.
DINOV3 = register_method(Method(
    name="dinov3", model="dinov3", loss="dinov3", required_hooks=("momentum_teacher", "gram_teacher"),
    transform="multicrop", masking="block", patch_tokens=True,
    rules=(sinkhorn_batch_rule, gram_rule, teacher_crops_rule, anchor_rule), sections=("gram", "hires.teacher_sizes"),
    summary=("DINOv3 (Siméoni et al., 2025): DINOv2's losses plus Gram anchoring of the patch features to a "
             "snapshot of the EMA teacher."),
))
