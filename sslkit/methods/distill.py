"""Distillation: a frozen teacher into one or several students, the teacher's forward computed once per step.

Two objectives (``distill.objective``), each a small function below with its formula and source:

* ``feature`` (LightlyTrain's ``distillationv2``, ``lightly_train/_methods/distillationv2``; its ``distillation`` now
  names v3, a queue of teacher embeddings as pseudo-classes, not here): each student's pooled
  feature and its feature map, projected to the teacher's width (a linear layer, per location for the map) and the
  map resized to the teacher's patch grid (bilinear), regress the teacher's pooled feature and patch features, as
  the teacher's trunk gives them after its final norm (the last ``teacher_blocks`` blocks' patch tokens
  concatenated: v2's ``n_teacher_blocks``, 2 there; 1 here by default) (:func:`feature_distillation_loss`, cosine or
  MSE). Works for any student with a feature map (ViTs, torchvision ResNets, the small CNN) and any teacher trunk.
* ``dino`` (DINOv3's distillation, facebookresearch/dinov3 ``train/multidist_meta_arch.py``): each student's own
  DINO head learns the frozen teacher's DINO head probabilities of the global crops (Sinkhorn-Knopp or centring, on
  every student crop but the same one) and, for a ViT student of the teacher's patch size, its iBOT head the
  teacher's iBOT head probabilities at the patches the mask generator picks; KoLeo on the student's global crops
  (:func:`dino_distillation_loss`). As DINOv3's code (``ssl_meta_arch.get_student_output``: ``masks if not
  self.is_distillation_enabled else None``), the student sees its global crops whole and its iBOT head reads its
  own patch tokens at those slots; ``distill.mask_student=true`` puts the mask token there instead (iBOT's
  self-distillation). The teacher must bring its heads: an sslkit ``dino_vit`` / ``ibot`` / ``dinov2`` / ``dinov3``
  run.

The teacher (:class:`FrozenTeacher`) is not a submodule of :class:`DistillModel`: no optimizer, DDP, FSDP2 or
checkpoint sees its parameters; it follows the model's device and dtype moves and stays in eval mode. The
checkpoint names it by its source and a digest of its weights (:class:`DistillTeacherHook`), and a resume reads it
from there again. The builder (:mod:`sslkit.builder.teacher`) reads the teacher and builds the students.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from sslkit import registry as R
from sslkit.clock import StepContext, TrainClock
from sslkit.errors import UserError
from sslkit.hooks.base import SSLHook, method_model
from sslkit.methods.base import Method, RunShape, register_method
from sslkit.methods.center import Center
from sslkit.methods.dino import DINOHead, dino_cross_entropy, dino_temperatures, mean_entropy
from sslkit.methods.dinov2 import CENTERING, SinkhornKnoppTeacher
from sslkit.methods.dinov2_parts import gather_slots, koleo_loss, masked_patch_loss, masked_slots
from sslkit.methods.ibot import CenteredTeacher
from sslkit.models.dense import dense_features, has_feature_map, map_channels, resize_bilinear
from sslkit.models.masking import Masks, crops_mask
from sslkit.models.output import ModelOutput
from sslkit.models.ssl_model import SSLModel, equal_shape_runs, forward_views
from sslkit.models.teacher import silence
from sslkit.models.tokens import TokenTrunk
from sslkit.models.weights import weights_digest
from sslkit.optim.schedules import TeacherTemperature
from sslkit.registry import register_hook, register_loss, register_model

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["DISTILL", "METRICS", "OBJECTIVES", "DistillError", "DistillLoss", "DistillModel", "DistillTeacherHook",
           "FrozenTeacher", "Projection", "Student", "StudentOutput", "StudentSpec", "TeacherOutput", "build_distill",
           "dino_distillation_loss", "feature_distillation_loss", "student_specs"]

logger = logging.getLogger("sslkit")

#: ``distill.objective``: LightlyTrain's feature regression or DINOv3's DINO + iBOT distillation.
OBJECTIVES = ("feature", "dino")
#: ``distill.metric`` of the feature objective.
METRICS = ("cosine", "mse")


class DistillError(UserError, ValueError):
    """A distillation that cannot run: the message names the ``distill.*`` key and what would work."""


class StudentSpec(dict):
    """One entry of ``distill.students`` made whole: ``name``, ``trunk``, ``trunk_kwargs``, ``lr_scale``."""


def student_specs(entries: Any) -> list[StudentSpec]:
    """``distill.students`` as specs: each entry a trunk name (``resnet18``) or a mapping ``{trunk, name,
    trunk_kwargs, lr_scale}`` (``name`` defaults to the trunk's, ``lr_scale`` to 1). Raises :class:`DistillError`
    for an empty list, an entry without a trunk, or a name given twice. ``entries``: plain values (the config's
    list as a container)."""
    items = entries
    if not isinstance(items, list) or not items:
        raise DistillError("distill.students must list at least one student: trunk names (distill.students="
                           "[small_cnn, resnet18]) or mappings {trunk: vit_small, name: vits, trunk_kwargs: {...}, "
                           "lr_scale: 1.0}")
    specs: list[StudentSpec] = []
    for i, item in enumerate(items):
        entry = {"trunk": item} if isinstance(item, str) else dict(item) if isinstance(item, dict) else None
        unknown = sorted(set(entry or {}) - {"trunk", "name", "trunk_kwargs", "lr_scale"})
        if entry is None or not isinstance(entry.get("trunk"), str) or unknown:
            raise DistillError(f"distill.students[{i}] = {item!r}: give a trunk name or a mapping with the keys "
                               f"trunk, name, trunk_kwargs, lr_scale{f' (not {unknown})' if unknown else ''}")
        spec = StudentSpec(name=str(entry.get("name") or entry["trunk"]), trunk=entry["trunk"],
                           trunk_kwargs=dict(entry.get("trunk_kwargs") or {}),
                           lr_scale=float(entry.get("lr_scale", 1.0)))
        if any(s["name"] == spec["name"] for s in specs):
            raise DistillError(f"distill.students names {spec['name']} twice: give each student its own name "
                               f"({{trunk: {spec['trunk']}, name: {spec['name']}_2}})")
        specs.append(spec)
    return specs


@dataclass
class TeacherOutput:
    """The frozen teacher's outputs of one step, computed once and read by every student's loss.

    ``pooled``: per teacher view ``[B, D]``; ``patches``: per teacher view ``[B, N, D]`` (None without a map);
    ``grid``: the patch grid of each view; for the ``dino`` objective ``logits`` ``[G, B, K]`` (the DINO head on the
    global crops) and, with masks, ``patch_logits`` ``[S, K]`` (the iBOT head at the batch's masked slots),
    ``patch_weights`` / ``patch_images`` ``[S]`` (:func:`~sslkit.methods.dinov2_parts.masked_slots`)."""

    pooled: list[torch.Tensor]
    patches: list[torch.Tensor] | None
    grid: list[tuple[int, int]]
    logits: torch.Tensor | None = None
    patch_logits: torch.Tensor | None = None
    patch_weights: torch.Tensor | None = None
    patch_images: torch.Tensor | None = None
    slots_index: torch.Tensor | None = None


@dataclass
class StudentOutput:
    """One student's outputs of one step: ``features`` (its pooled features per view), and per objective
    ``global_pred`` / ``patch_pred`` (``feature``: per teacher view ``[B, D_t]`` and ``[B, N_t, D_t]``) or
    ``projections`` / ``patch_logits`` (``dino``: its DINO head's logits per view, its iBOT head's at the masked
    slots, None for a student without an iBOT head)."""

    features: list[torch.Tensor]
    global_pred: list[torch.Tensor] | None = None
    patch_pred: list[torch.Tensor] | None = None
    projections: list[torch.Tensor] | None = None
    patch_logits: torch.Tensor | None = None


class FrozenTeacher(nn.Module):
    """A teacher that never trains: ``trunk`` (any trunk :func:`~sslkit.models.dense.dense_features` reads) and, for
    the ``dino`` objective, its DINO ``head`` and iBOT ``patch_head``; every parameter without gradient, every
    stochastic layer off, eval mode whatever ``train()`` asks. ``source`` names where it was read from. ``blocks``:
    a ViT teacher's features per location are the patch tokens of its last ``blocks`` blocks, each through the final
    norm, concatenated (:meth:`~sslkit.models.tokens.TokenTrunk.last_patch_maps`; LightlyTrain ``distillationv2``'s
    ``n_teacher_blocks``); 1: its final tokens."""

    def __init__(self, trunk: nn.Module, head: nn.Module | None = None, patch_head: nn.Module | None = None,
                 source: str = "", blocks: int = 1) -> None:
        super().__init__()
        self.trunk, self.head, self.patch_head = trunk, head, patch_head
        self.source = source
        self.blocks = 1
        self.use_blocks(blocks)
        for p in self.parameters():
            p.requires_grad_(False)
        silence(self)
        super().train(False)
        #: the digest of the weights as read (:func:`weights_digest`)
        self.digest = weights_digest(self)

    def train(self, mode: bool = True) -> FrozenTeacher:
        """Stays in eval mode (BatchNorm on its running statistics, as DINOv3's teachers)."""
        return super().train(False)

    def use_blocks(self, blocks: int) -> None:
        """Read the features per location from the last ``blocks`` blocks (``distill.teacher_blocks``)."""
        blocks = int(blocks)
        depth = len(getattr(self.trunk, "blocks", ())) if isinstance(self.trunk, TokenTrunk) else 0
        if blocks != 1 and not 1 <= blocks <= depth:
            what = f"has {depth} blocks" if depth else f"({type(self.trunk).__name__}) is not a ViT"
            raise DistillError(f"distill.teacher_blocks={blocks}: the teacher {self.source} {what}; the last blocks' "
                               "patch tokens concatenated need a ViT teacher with that many blocks (1: its final "
                               "tokens, any trunk)")
        self.blocks = blocks

    @property
    def dim(self) -> int:
        """The width of the pooled features."""
        return int(self.trunk.out_dim)

    @property
    def patch_dim(self) -> int | None:
        """The width of the features per location, or None for a trunk without a map."""
        return map_channels(self.trunk) * self.blocks if has_feature_map(self.trunk) else None

    @property
    def patch_size(self) -> int | None:
        """A ViT teacher's patch size (None for a CNN)."""
        return int(self.trunk.patch_size) if isinstance(self.trunk, TokenTrunk) else None

    @torch.no_grad()
    def encode(self, views: Sequence[torch.Tensor], dense: bool) -> tuple[list[torch.Tensor], list[Any]]:
        """Per view, the pooled features and (``dense``) the map ``[B, h, w, C]``; views of one shape in one
        forward."""
        pooled: list[torch.Tensor] = []
        maps: list[Any] = []
        for n, batch in equal_shape_runs(views):
            if dense and self.blocks > 1:
                pooled_batch, map_batch = self.trunk.last_patch_maps(batch, self.blocks)
                pooled += list(pooled_batch.chunk(n))
                maps += list(map_batch.chunk(n))
            elif dense:
                out = dense_features(self.trunk, batch)
                pooled += list(out.pooled.chunk(n))
                maps += list(out.map.chunk(n))
            else:
                pooled += list(self.trunk(batch).chunk(n))
                maps += [None] * n
        return pooled, maps


class Student(nn.Module):
    """One student: its ``trunk`` and what maps it onto the teacher. ``feature``: ``global_proj`` (pooled width ->
    the teacher's) and ``patch_proj`` (the map's channels -> the teacher's patch width, per location; None without
    the dense term), initialised as LightlyTrain's (truncated normal, std 0.02). ``dino``: a DINO ``head`` with the
    teacher head's outputs and, for a ViT student with a mask token, a ``patch_head`` with the teacher iBOT head's."""

    def __init__(self, trunk: nn.Module, head: nn.Module | None = None, patch_head: nn.Module | None = None,
                 global_proj: nn.Module | None = None, patch_proj: nn.Module | None = None) -> None:
        super().__init__()
        self.trunk, self.head, self.patch_head = trunk, head, patch_head
        self.global_proj, self.patch_proj = global_proj, patch_proj

    @property
    def masked(self) -> bool:
        """The student learns the teacher's patches at the mask's slots (an iBOT head on a ViT)."""
        return self.patch_head is not None


class Projection(nn.Linear):
    """A student's linear map onto the teacher's width (its own type, so that ``machine.compile`` finds the
    projections and not every linear layer inside the trunks), initialised as LightlyTrain's: truncated normal
    weights of std 0.02, zero bias."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__(in_dim, out_dim)
        nn.init.trunc_normal_(self.weight, std=0.02)
        nn.init.zeros_(self.bias)


class DistillModel(SSLModel):
    """Students (``students``, by name, in order) and one frozen teacher whose forward runs once per step.

    ``forward(views, masks)``: the teacher encodes its views (``feature``: every view; ``dino``: the ``num_global``
    global crops, whole) under ``no_grad``; then each student runs on every view (with ``mask_student``, a ViT
    student with an iBOT head sees the mask token at the masked patches of its global crops; without, DINOv3's
    distillation, it sees them whole). The output's ``teacher`` field is the :class:`TeacherOutput`, ``students`` the
    :class:`StudentOutput` of each student by name, ``features`` the first student's pooled features.

    ``trunk`` is the trunk of the student :attr:`primary` names (the first): what the kNN hook, the evaluation tools
    and the export read; :meth:`select` picks another. An :class:`~sslkit.models.ssl_model.SSLModel` without a head
    of its own (each student has its own) and without momentum teachers.
    """

    def __init__(self, teacher: FrozenTeacher, students: dict[str, Student], objective: str = "feature",
                 num_global: int = 2, lr_scales: dict[str, float] | None = None, mask_student: bool = False) -> None:
        nn.Module.__init__(self)  # (SSLModel's would register one trunk; this model's trunk is a student's)
        self.head = nn.Identity()
        if objective not in OBJECTIVES:
            raise DistillError(f"distill.objective={objective!r}: use one of {', '.join(OBJECTIVES)}")
        if not students:
            raise DistillError("distill.students is empty: name at least one student trunk (distill.students="
                               "[small_cnn], [resnet18, vit_small], ...)")
        self.students = nn.ModuleDict(students)
        self.objective, self.num_global, self.mask_student = objective, int(num_global), bool(mask_student)
        self.primary = next(iter(students))
        self.lr_scales = dict(lr_scales or {})
        # not a submodule: no parameters in the optimizer, DDP or FSDP2, nothing in the state dict (see _apply)
        self.__dict__["teacher"] = teacher

    @property
    def trunk(self) -> nn.Module:
        """The trunk of the selected student (:attr:`primary`)."""
        return self.students[self.primary].trunk

    def select(self, name: str) -> None:
        """Make student ``name`` the one :attr:`trunk` gives (the export's ``student=``)."""
        if name not in self.students:
            raise DistillError(f"student={name}: the run's students are {', '.join(self.students)}")
        self.primary = name

    def param_owners(self) -> dict[str, float]:
        """Each student's parameter prefix and its learning-rate scale: the optimizer gives every student its own
        parameter groups (:func:`~sslkit.optim.param_groups`) and the update clips each student's gradients alone."""
        return {f"students.{name}.": float(self.lr_scales.get(name, 1.0)) for name in self.students}

    def compiled_kinds(self) -> tuple[type, ...]:
        """What ``machine.compile`` compiles: every student's trunk and heads (the teacher's trunk is compiled by the
        builder beside them)."""
        kinds = {type(s.trunk) for s in self.students.values()} | {Projection}
        kinds |= {type(h) for s in self.students.values() for h in (s.head, s.patch_head) if h is not None}
        return tuple(sorted(kinds, key=lambda t: t.__name__))

    def _apply(self, fn: Any, recurse: bool = True) -> DistillModel:
        super()._apply(fn, recurse)
        self.teacher._apply(fn, recurse)  # the teacher follows .to(device / dtype / memory format)
        return self

    def forward(self, views: Sequence[torch.Tensor] | torch.Tensor,
                masks: Sequence[Masks | None] | None = None) -> ModelOutput:
        """The teacher once, then every student (see the class docstring)."""
        views = [views] if isinstance(views, torch.Tensor) else list(views)
        if self.objective == "feature":
            teacher = self._teacher_features(views)
            outs = {name: self._feature_student(s, views, teacher) for name, s in self.students.items()}
        else:
            teacher, mask = self._teacher_dino(views, masks)
            outs = {name: self._dino_student(s, views, teacher, mask) for name, s in self.students.items()}
        first = outs[self.primary]
        return ModelOutput(features=first.features, projections=first.projections or first.global_pred or [],
                           teacher=teacher, students=outs)

    # ------------------------------------------------------------------------------------------ feature objective
    @torch.no_grad()
    def _teacher_features(self, views: list[torch.Tensor]) -> TeacherOutput:
        dense = any(s.patch_proj is not None for s in self.students.values())
        pooled, maps = self.teacher.encode(views, dense)
        patches = [m.flatten(1, 2) for m in maps] if dense else None
        grid = [tuple(m.shape[1:3]) for m in maps] if dense else [(1, 1)] * len(views)
        return TeacherOutput(pooled=pooled, patches=patches, grid=grid)

    @staticmethod
    def _feature_student(student: Student, views: list[torch.Tensor], teacher: TeacherOutput) -> StudentOutput:
        features, global_pred, patch_pred = [], [], []
        for v, view in enumerate(views):
            if student.patch_proj is None:
                pooled = student.trunk(view)
            else:
                pooled, fmap = dense_features(student.trunk, view)
                mapped = student.patch_proj(fmap).permute(0, 3, 1, 2)  # [B, D_t, h, w]
                mapped = resize_bilinear(mapped, teacher.grid[v])  # (deterministic on CUDA too)
                patch_pred.append(mapped.flatten(2).transpose(1, 2))  # [B, N_t, D_t]
            features.append(pooled)
            global_pred.append(student.global_proj(pooled))
        return StudentOutput(features=features, global_pred=global_pred, patch_pred=patch_pred or None)

    # ---------------------------------------------------------------------------------------------- dino objective
    @torch.no_grad()
    def _teacher_dino(self, views: list[torch.Tensor], masks: Sequence[Masks | None] | None
                      ) -> tuple[TeacherOutput, torch.Tensor | None]:
        g = self.num_global
        if len(views) < g:
            raise ValueError(f"distill.objective=dino needs {g} global crops, got {len(views)} views")
        globals_ = torch.cat(views[:g]) if g > 1 else views[0]
        masked = any(s.masked for s in self.students.values())
        pooled, maps = self.teacher.encode([globals_], dense=masked)
        logits = self.teacher.head(pooled[0]).unflatten(0, (g, -1))  # [G, B, K]
        out = TeacherOutput(pooled=list(pooled[0].chunk(g)), patches=None, grid=[], logits=logits)
        given = list(masks or [])[:g]
        if not masked or not any(m is not None for m in given):
            return out, None
        patches = maps[0].flatten(1, 2)  # [G B, N, D]
        n = patches.shape[1]
        mask, slots = crops_mask(views[:g], given + [None] * (g - len(given)), n)
        index, weight = masked_slots(mask.reshape(1, -1), slots)
        out.patch_logits = self.teacher.patch_head(gather_slots(patches.flatten(0, 1)[None], index)[0])
        out.patch_weights, out.patch_images, out.slots_index = weight[0], index[0] // n, index
        return out, mask

    def _dino_student(self, student: Student, views: list[torch.Tensor], teacher: TeacherOutput,
                      mask: torch.Tensor | None) -> StudentOutput:
        g = self.num_global
        patch_logits = None
        if student.masked and mask is not None:
            trunk: TokenTrunk = student.trunk  # type: ignore[assignment]
            tokens = trunk.forward_tokens(torch.cat(views[:g]) if g > 1 else views[0],
                                          mask=mask if self.mask_student else None)
            features = list(trunk.pool_tokens(tokens).chunk(g))
            if len(views) > g:
                features += forward_views(trunk, views[g:])
            patch_logits = student.patch_head(gather_slots(tokens.patches.flatten(0, 1)[None], teacher.slots_index)[0])
        else:
            features = forward_views(student.trunk, views)
        projections = student.head(torch.cat(features)).split([f.shape[0] for f in features])
        return StudentOutput(features=features, projections=list(projections), patch_logits=patch_logits)


@register_model("distill")
def build_distill(trunk: nn.Module | None = None, head: nn.Module | None = None, teacher: FrozenTeacher | None = None,
                  students: dict[str, nn.Module] | None = None, objective: str = "feature", dense: bool = True,
                  num_global: int = 2, head_kwargs: dict[str, Any] | None = None,
                  lr_scales: dict[str, float] | None = None, mask_student: bool = False,
                  teacher_blocks: int = 1) -> DistillModel:
    """Distillation wiring from the builder's teacher (:class:`FrozenTeacher`) and student trunks (by name):
    ``feature`` gives each student its projections (``dense``: the per-location one too), ``dino`` its DINO head
    (``head_kwargs``: the ``model.head`` settings, the teacher head's outputs) and, for a ViT student of the
    teacher's patch size, an iBOT head (``mask_student``: with a mask token, see :class:`DistillModel`).
    ``teacher_blocks``: the teacher's features per location from its last blocks (:class:`FrozenTeacher`).
    ``trunk`` / ``head`` (the generic builder's) are not used."""
    if teacher is None or students is None:
        raise DistillError("method.name=distill is built by sslkit's builder from distill.teacher and "
                           "distill.students (config=distill)")
    kwargs = dict(head_kwargs or {})
    if objective == "dino" and int(teacher_blocks) != 1:
        raise DistillError(f"distill.teacher_blocks={teacher_blocks}: the dino objective reads the teacher's heads on "
                           "its final tokens; the last blocks concatenated are the feature objective's (LightlyTrain "
                           "distillationv2): set distill.teacher_blocks=1 or distill.objective=feature")
    teacher.use_blocks(teacher_blocks)
    built = {name: _student(name, t, teacher, objective, dense, kwargs, mask_student) for name, t in students.items()}
    return DistillModel(teacher, built, objective, num_global, lr_scales, mask_student)


def _student(name: str, trunk: nn.Module, teacher: FrozenTeacher, objective: str, dense: bool,
             head_kwargs: dict[str, Any], mask_student: bool = False) -> Student:
    """Student ``name`` on ``trunk``, fitted to ``teacher`` (the errors say which key to change)."""
    if objective == "feature":
        patch_proj = None
        if dense:
            if not has_feature_map(trunk):
                raise DistillError(f"distill.students: {name} ({type(trunk).__name__}) has no feature map, and the "
                                   "feature objective's dense term regresses the teacher's patch features with one: "
                                   "set distill.patch_weight=0 (the pooled features only) or pick a ViT, ResNet or "
                                   "small_cnn student")
            if teacher.patch_dim is None:
                raise DistillError(f"distill.teacher={teacher.source}: the teacher gives no features per location "
                                   "for the dense term: set distill.patch_weight=0")
            patch_proj = Projection(map_channels(trunk), teacher.patch_dim)
        return Student(trunk, global_proj=Projection(int(trunk.out_dim), teacher.dim), patch_proj=patch_proj)
    if teacher.head is None:
        raise DistillError(f"distill.teacher={teacher.source} has no DINO head, and distill.objective=dino learns "
                           "its probabilities: give an sslkit dino_vit, ibot, dinov2 or dinov3 run, or use "
                           "distill.objective=feature (released weights have the backbone only)")
    kwargs = {k: v for k, v in head_kwargs.items() if k not in ("in_dim", "out_dim")}
    head = DINOHead(in_dim=int(trunk.out_dim), out_dim=int(teacher.head.out_dim), **kwargs)
    patch_head = None
    if dense and isinstance(trunk, TokenTrunk) and teacher.patch_head is not None:
        if teacher.patch_size != trunk.patch_size:
            raise DistillError(f"distill.students: {name} has {trunk.patch_size} px patches and the teacher "
                               f"{teacher.patch_size} px, so the iBOT term cannot match their patches one to one: "
                               "give the student the teacher's patch size (its trunk_kwargs.patch_size) or set "
                               "distill.patch_weight=0")
        if mask_student:
            trunk.enable_mask_token()
        patch_head = DINOHead(in_dim=int(trunk.out_dim), out_dim=int(teacher.patch_head.out_dim), **kwargs)
    return Student(trunk, head=head, patch_head=patch_head)


# ------------------------------------------------------------------------------------------------------ objectives
def feature_distillation_loss(student: torch.Tensor, teacher: torch.Tensor, metric: str = "cosine") -> torch.Tensor:
    r"""LightlyTrain's feature distillation term (``distillationv2_loss.py``: MSE on the features as they are) for
    student predictions ``s`` and teacher features ``t`` of the same shape ``[..., D]``:

    .. math::

        \text{mse}: \frac{1}{M D} \sum_m \lVert s_m - t_m \rVert^2, \qquad
        \text{cosine}: \frac{1}{M} \sum_m \Bigl(1 - \frac{s_m \cdot t_m}{\lVert s_m \rVert \lVert t_m \rVert}\Bigr)

    over the ``M`` rows (images, or images x patches). The teacher's features are its trunk's after the final norm
    (LightlyTrain regresses DINOv2's normed patch tokens). Float32; no gradient to the teacher."""
    s, t = student.float(), teacher.detach().float()
    if metric == "mse":
        return F.mse_loss(s, t)
    if metric == "cosine":
        return (1.0 - F.cosine_similarity(s, t, dim=-1, eps=1e-8)).mean()
    raise DistillError(f"distill.metric={metric!r}: use one of {', '.join(METRICS)}")


def dino_distillation_loss(projections: Sequence[torch.Tensor], cls_probs: torch.Tensor,
                           features: Sequence[torch.Tensor], num_global: int, student_temp: float = 0.1,
                           patch_logits: torch.Tensor | None = None, patch_probs: torch.Tensor | None = None,
                           patch_weights: torch.Tensor | None = None, patch_images: torch.Tensor | None = None,
                           ibot_weight: float = 1.0, koleo_weight: float = 0.1,
                           koleo_global: bool = True) -> dict[str, torch.Tensor]:
    r"""DINOv3's distillation loss for one student (``multidist_meta_arch.py`` with ``ssl_meta_arch.compute_losses``)::

        L = L_DINO + ibot_weight L_iBOT + koleo_weight sum_g KoLeo(z_g)

    ``L_DINO`` (:func:`~sslkit.methods.dino.dino_cross_entropy`): the mean over pairs (teacher global crop ``i``,
    student crop ``v != i``) of ``-sum_k P_t(x_i)_k log softmax(h_s(x_v) / tau_s)_k``, ``P_t`` the frozen teacher's
    probabilities ``cls_probs`` ``[G, B, K]``; ``L_iBOT`` (:func:`~sslkit.methods.dinov2_parts.masked_patch_loss`):
    the student's iBOT logits at the masked slots against the teacher's probabilities there (when both are given);
    KoLeo (:func:`~sslkit.methods.dinov2_parts.koleo_loss`) on each global crop's pooled student features."""
    dino = dino_cross_entropy(projections, cls_probs, student_temp)
    loss = dino
    out: dict[str, torch.Tensor] = {"dino_loss": dino.detach()}
    if patch_logits is not None and patch_probs is not None and patch_weights is not None:
        images = int(cls_probs.shape[0] * cls_probs.shape[1])
        ibot = masked_patch_loss(patch_logits, patch_probs, patch_weights, student_temp, patch_images, images)
        loss = loss + ibot_weight * ibot
        out["ibot_loss"] = ibot.detach()
    if koleo_weight:
        koleo = torch.stack([koleo_loss(f, gather=koleo_global) for f in features[:num_global]]).sum()
        loss = loss + koleo_weight * koleo
        out["koleo_loss"] = koleo.detach()
    out["loss"] = loss
    return out


@register_loss("distill")
class DistillLoss(nn.Module):
    """The sum over the students of their objective's loss (one graph per student: the gradients do not mix), each
    logged as ``loss_<student>`` with its terms (``<term>_<student>``).

    ``feature``: ``global_weight`` times :func:`feature_distillation_loss` of the projected pooled features plus
    ``patch_weight`` times that of the projected, resized feature maps, averaged over the views. ``dino``:
    :func:`dino_distillation_loss` with the teacher's probabilities computed once per step for all students:
    ``centering=sinkhorn_knopp`` (DINOv3's distillation, ``sinkhorn_iterations``) or ``centering`` (a centre of the
    teacher's logits, as DINO: ``out_dim`` / ``patch_out_dim`` the teacher heads' prototypes), sharpened by
    ``teacher_temp`` after a warm-up from ``warmup_teacher_temp`` over ``warmup_teacher_temp_steps`` updates.
    """

    def __init__(self, objective: str = "feature", metric: str = "cosine", global_weight: float = 1.0,
                 patch_weight: float = 1.0, out_dim: int | None = None, patch_out_dim: int | None = None,
                 student_temp: float = 0.1, teacher_temp: float = 0.07, warmup_teacher_temp: float = 0.04,
                 warmup_teacher_temp_steps: int = 0, centering: str = "sinkhorn_knopp", sinkhorn_iterations: int = 3,
                 center_momentum: float = 0.9, koleo_weight: float = 0.1, koleo_global: bool = True) -> None:
        super().__init__()
        if objective not in OBJECTIVES:
            raise DistillError(f"distill.objective={objective!r}: use one of {', '.join(OBJECTIVES)}")
        if metric not in METRICS:
            raise DistillError(f"distill.metric={metric!r}: use one of {', '.join(METRICS)}")
        if centering not in CENTERING:
            raise DistillError(f"loss.centering={centering!r}: use one of {', '.join(CENTERING)}")
        self.objective, self.metric = objective, metric
        self.global_weight, self.patch_weight = float(global_weight), float(patch_weight)
        self.student_temp, self.teacher_temp = dino_temperatures(student_temp, teacher_temp, warmup_teacher_temp,
                                                                 warmup_teacher_temp_steps)
        self.patch_temp = TeacherTemperature(teacher_temp, warmup_teacher_temp, warmup_teacher_temp_steps)
        self.koleo_weight, self.koleo_global = float(koleo_weight), bool(koleo_global)
        self.teacher_rule: Any = SinkhornKnoppTeacher(int(sinkhorn_iterations))
        if objective == "dino" and centering == "centering":
            if out_dim is None:
                raise DistillError("loss.centering=centering keeps a centre of the teacher head's outputs: set "
                                   "loss.out_dim (and loss.patch_out_dim) to the teacher head's prototypes, or use "
                                   "loss.centering=sinkhorn_knopp (DINOv3's distillation; no centre)")
            self.cls_center = Center(int(out_dim), center_momentum)
            self.patch_center = Center(int(patch_out_dim or out_dim), center_momentum)
            self.teacher_rule = CenteredTeacher(self.cls_center, self.patch_center)

    def forward(self, output: Any, sample: dict[str, Any], ctx: StepContext | None = None) -> dict[str, torch.Tensor]:
        """Every student's loss, summed; the terms logged per student."""
        teacher: TeacherOutput = output["teacher"]
        students: dict[str, StudentOutput] = output["students"]
        if self.objective == "feature":
            per = {name: self._feature(s, teacher) for name, s in students.items()}
        else:
            per = self._dino(students, teacher, output, ctx)
        out: dict[str, torch.Tensor] = {"loss": torch.stack([p["loss"] for p in per.values()]).sum()}
        for name, terms in per.items():
            for key, value in terms.items():
                out[f"loss_{name}" if key == "loss" else f"{key}_{name}"] = value.detach()
        return out

    def _feature(self, s: StudentOutput, teacher: TeacherOutput) -> dict[str, torch.Tensor]:
        glob = torch.stack([feature_distillation_loss(p, t, self.metric)
                            for p, t in zip(s.global_pred or [], teacher.pooled)]).mean()
        terms = {"global_loss": glob}
        loss = self.global_weight * glob
        if s.patch_pred is not None and teacher.patches is not None:
            patch = torch.stack([feature_distillation_loss(p, t, self.metric)
                                 for p, t in zip(s.patch_pred, teacher.patches)]).mean()
            terms["patch_loss"] = patch
            loss = loss + self.patch_weight * patch
        return {"loss": loss, **terms}

    def _dino(self, students: dict[str, StudentOutput], teacher: TeacherOutput, output: Any,
              ctx: StepContext | None) -> dict[str, dict[str, torch.Tensor]]:
        clock = ctx.clock if ctx is not None else TrainClock()
        temp = self.teacher_temp.at(clock)
        logits = teacher.logits
        assert logits is not None
        if isinstance(self.teacher_rule, CenteredTeacher) and logits.shape[-1] != self.cls_center.value.shape[-1]:
            raise DistillError(f"loss.out_dim={self.cls_center.value.shape[-1]} but the teacher's DINO head gives "
                               f"{logits.shape[-1]} prototypes: set loss.out_dim={logits.shape[-1]}")
        cls_probs = self.teacher_rule.cls_probs(list(logits), temp)
        patch_probs = None
        if teacher.patch_logits is not None:
            patch_probs = self.teacher_rule.patch_probs([teacher.patch_logits], [teacher.patch_weights],
                                                        self.patch_temp.at(clock))[0]
        if self.training and torch.is_grad_enabled():  # the centres move (Sinkhorn-Knopp: nothing to move)
            masked = teacher.patch_logits is not None
            self.teacher_rule.after_train_forward({"targets": list(logits),
                                                   "patch_targets": [teacher.patch_logits] if masked else [],
                                                   "patch_weights": [teacher.patch_weights] if masked else []}, ctx)
        if ctx is not None:
            ctx.record("teacher_temp", temp)
        per = {}
        for name, s in students.items():
            per[name] = dino_distillation_loss(
                s.projections or [], cls_probs, s.features, len(logits), self.student_temp, s.patch_logits,
                patch_probs, teacher.patch_weights, teacher.patch_images, self.patch_weight, self.koleo_weight,
                self.koleo_global)
        per[next(iter(per))]["teacher_entropy"] = mean_entropy(cls_probs[0])
        return per


@register_hook("distill_teacher")
class DistillTeacherHook(SSLHook):
    """Keeps the teacher out of the checkpoint and the run honest about it: the checkpoint holds the teacher's
    ``source`` and weights ``digest`` (not its weights); a resumed run, which read the teacher from its source
    again, stops with a message when the digest differs (the file changed since the run began)."""

    name = "distill_teacher"

    def __init__(self) -> None:
        self.saved: dict[str, str] | None = None

    def on_start(self, task: SSLTask) -> None:
        """Log the teacher; on a resume, compare its digest with the checkpoint's."""
        teacher = self._model(task).teacher
        if self.saved is not None and self.saved.get("digest") != teacher.digest:
            raise DistillError(f"distill.teacher={teacher.source}: its weights are not those the run began with "
                               f"(digest {teacher.digest[:12]}, the checkpoint's {self.saved.get('digest', '')[:12]} "
                               f"from {self.saved.get('source')}): the students would learn another teacher from here. "
                               "Give the run's teacher again, or start a new run (another output_dir)")
        self.saved = {"source": teacher.source, "digest": teacher.digest}
        logger.info("distill: teacher %s (%s, %d parameters, digest %s), students %s", teacher.source,
                    type(teacher.trunk).__name__, sum(p.numel() for p in teacher.parameters()), teacher.digest[:12],
                    ", ".join(self._model(task).students))

    @staticmethod
    def _model(task: SSLTask) -> DistillModel:
        return method_model(task, DistillModel, "distill_teacher", "distill", DistillError)

    def state_dict(self) -> dict[str, Any]:
        """The teacher's source and digest, as the run read it (the checkpoint is written while it runs)."""
        return dict(self.saved) if self.saved is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpoint's source and digest, checked at :meth:`on_start`."""
        self.saved = {k: str(v) for k, v in state.items()} or None


#: The method object: what ``method.name=distill`` trains.
#: ``model.kwargs`` the distillation builder fills itself, and the key a user sets instead.
ROUTED_KWARGS = {"teacher": "distill.teacher", "students": "distill.students", "objective": "distill.objective",
                 "dense": "distill.patch_weight", "head_kwargs": "model.head", "lr_scales": "distill.students",
                 "mask_student": "distill.mask_student", "teacher_blocks": "distill.teacher_blocks"}


def _known_trunk(name: str, where: str) -> list[str]:
    try:
        R.get(R.TRUNKS, name, where=where)
    except R.UnknownNameError as exc:
        return [str(exc)]
    return []


def distill_rule(shape: RunShape) -> list[str]:
    """``distill.*``: a teacher that exists, a known teacher trunk, objective and metric, the teacher's sharding and
    blocks, students that parse (a trunk each, no name twice, registered trunks), ``model.trunk`` the first
    student's, and no ``model.kwargs`` the builder fills from ``distill.*``."""
    d = shape.sections.get("distill", {})
    errors = []
    teacher, trunk = d.get("teacher"), d.get("teacher_trunk")
    if teacher is not None and not os.path.exists(os.path.expanduser(str(teacher))):
        errors.append(f"'distill.teacher' = {teacher}: no such file or folder; give an sslkit run folder, a "
                      "checkpoint, or a .pth / .safetensors weights file (with distill.teacher_trunk)")
    if trunk is not None and not str(trunk).startswith("timm:"):
        errors += _known_trunk(str(trunk), "distill.teacher_trunk")
    objective, blocks = d.get("objective"), d.get("teacher_blocks", 1)
    if objective not in OBJECTIVES:
        errors.append(f"'distill.objective' = {objective}: use one of {', '.join(OBJECTIVES)}")
    if d.get("metric") not in METRICS:
        errors.append(f"'distill.metric' = {d.get('metric')}: use one of {', '.join(METRICS)}")
    if d.get("teacher_shard", "auto") not in ("auto", True, False):
        errors.append(f"'distill.teacher_shard' must be auto, true or false, got {d.get('teacher_shard')!r}")
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
        errors.append(f"'distill.teacher_blocks' must be >= 1 (1: the teacher's final tokens), got {blocks!r}")
    elif objective == "dino" and blocks != 1:
        errors.append(f"'distill.teacher_blocks' = {blocks}: the dino objective reads the teacher's heads on its "
                      "final tokens; the last blocks concatenated are the feature objective's (LightlyTrain "
                      "distillationv2): set distill.teacher_blocks=1 or distill.objective=feature")
    try:
        specs = student_specs(d.get("students"))
    except DistillError as exc:
        return [*errors, str(exc)]
    for spec in specs:
        errors += _known_trunk(spec["trunk"], f"distill.students ({spec['name']})")
    for key in sorted(set(shape.model_kwargs) & set(ROUTED_KWARGS)):
        errors.append(f"'model.kwargs.{key}' is the builder's to set for a distillation (from {ROUTED_KWARGS[key]}): "
                      f"drop it and set {ROUTED_KWARGS[key]}")
    if shape.trunk != specs[0]["trunk"]:
        errors.append(f"'model.trunk' = {shape.trunk}, but a distillation's model.trunk is its first student's "
                      f"({specs[0]['trunk']}): leave model.trunk unset (null), it is filled from distill.students")
    return errors


def first_student(cfg: Any) -> None:
    """A distillation leaves ``model.trunk`` null: it becomes the first student's trunk, ``model.trunk_kwargs`` its
    kwargs (what validation, the kNN hook and the tools' records read). ``cfg``: the composed config; entries that
    do not parse are left for :func:`distill_rule` to report."""
    students = cfg.distill.students
    if cfg.model.get("trunk") is not None or isinstance(students, str) or not isinstance(students, Sequence) \
            or not students:
        return
    first = students[0]
    if isinstance(first, str):
        cfg.model.trunk, cfg.model.trunk_kwargs = first, {}
    elif hasattr(first, "get") and isinstance(first.get("trunk"), str):
        cfg.model.trunk, cfg.model.trunk_kwargs = first.trunk, first.get("trunk_kwargs") or {}


DISTILL = register_method(Method(
    name="distill", model="distill", loss="distill", required_hooks=("distill_teacher",), transform="simclr",
    takes_masks=True, rules=(distill_rule,), sections=("distill",), complete=first_student,
    summary=("Distillation of a frozen teacher (an sslkit run, DINOv2/DINOv3 weights, a timm model) into one or "
             "several students: feature regression (LightlyTrain) or DINO + iBOT (DINOv3)."),
))
