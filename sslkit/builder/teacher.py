"""Distillation's parts from the config: the frozen teacher read from its source, the student trunks by name."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig
from torch import nn

from sslkit import registry as R
from sslkit.builder.common import trunk_kwargs
from sslkit.builder.runs import in_channels as checkpoint_channels
from sslkit.builder.runs import read_run_checkpoint
from sslkit.checkpoint import CheckpointError
from sslkit.methods.dino import DINOHead
from sslkit.methods.distill import DistillError, FrozenTeacher, StudentSpec
from sslkit.models.dense import TimmDense
from sslkit.models.hf_weights import hf_config, hf_trunk
from sslkit.models.weights import WeightsError, load_trunk, read_weights

__all__ = ["build_students", "load_teacher"]

logger = logging.getLogger("sslkit")

#: ``distill.teacher_trunk`` of a timm architecture: ``timm:<model name>``.
TIMM_PREFIX = "timm:"


def build_students(specs: list[StudentSpec], in_channels: int, image_size: int, patch_size: int
                   ) -> dict[str, nn.Module]:
    """The student trunks, fresh, by name, in order."""
    students = {}
    for spec in specs:
        builder = R.get(R.TRUNKS, spec["trunk"], f"distill.students ({spec['name']})")
        students[spec["name"]] = builder(**trunk_kwargs(builder, spec["trunk_kwargs"], in_channels, image_size,
                                                          patch_size))
    return students


def load_teacher(source: str, trunk_name: str | None, arguments: dict[str, Any], in_channels: int,
                 image_size: int, patch_size: int, rebuild: Callable[[DictConfig, int], nn.Module]) -> FrozenTeacher:
    """The frozen teacher ``distill.teacher`` names:

    * an sslkit run folder, checkpoint file or sharded checkpoint folder (``trunk_name`` None): the run's model
      rebuilt from its stored config and loaded, and from it the EMA teacher's trunk and heads where it has one
      (DINO, iBOT, DINOv2, DINOv3, BYOL, MoCo), else its trunk (and a DINO head if it has one);
    * a weights file (``.pth`` / ``.safetensors``) with ``trunk_name``: an sslkit trunk (``vit_large_patch16_dinov3``,
      ...; Meta's and timm's layouts, :func:`~sslkit.models.weights.load_trunk`) or ``timm:<model>`` (any timm
      architecture, its own layout, loaded strictly), built with ``arguments`` (``distill.teacher_trunk_kwargs``);
    * a transformers DINOv2 / DINOv3 checkpoint folder: the trunk its config.json describes, its weights.

    ``rebuild(config, in_channels)`` builds a run's model from its config (the builder's ``build_model``).
    Raises :class:`DistillError` naming ``distill.teacher`` (or ``distill.teacher_trunk``) when it cannot be read."""
    if not source:
        raise DistillError("distill.teacher is not set: give a run folder or checkpoint of an sslkit run, or a "
                           "weights file with distill.teacher_trunk (see configs/config/distill.yaml)")
    path = os.path.expanduser(str(source))
    if not os.path.exists(path):
        raise DistillError(f"distill.teacher={source}: no such file or folder. Give a run folder (its latest "
                           "checkpoint), a checkpoint file, or a .pth / .safetensors weights file")
    config = hf_config(path) if trunk_name is None else None
    if config is not None:  # a transformers checkpoint: its config.json gives the trunk
        try:
            trunk_name, given = hf_trunk(config)
        except ValueError as exc:
            raise DistillError(f"distill.teacher={source}: a transformers {config['model_type']} of {exc}") from None
        given.pop("in_channels")  # built for the data's channels: the file's patch embedding is adapted on loading
        arguments = {**given, **arguments}
    if trunk_name is None:
        teacher = _teacher_from_run(str(source), rebuild)
        convs = [m for m in teacher.trunk.modules() if isinstance(m, nn.Conv2d)]
        if convs and convs[0].in_channels != in_channels:
            raise DistillError(f"distill.teacher={source} takes {convs[0].in_channels}-channel images and the data "
                               f"has {in_channels}: train the students on the teacher's kind of images (a "
                               f"{convs[0].in_channels}-channel dataset) or distill a teacher of this data")
        return teacher
    if trunk_name.startswith(TIMM_PREFIX):
        return _teacher_from_timm(path, trunk_name[len(TIMM_PREFIX):], arguments, in_channels)
    builder = R.get(R.TRUNKS, trunk_name, "distill.teacher_trunk")
    trunk = builder(**trunk_kwargs(builder, arguments, in_channels, image_size, patch_size))
    try:
        load_trunk(trunk, path, "distill.teacher", "distill.teacher_trunk")
    except WeightsError as exc:
        raise DistillError(str(exc)) from None
    return FrozenTeacher(trunk, source=str(source))


def _teacher_from_run(source: str, rebuild: Callable[[DictConfig, int], nn.Module]) -> FrozenTeacher:
    """The teacher parts of an sslkit run's model (see :func:`load_teacher`)."""
    try:
        path, _, state, cfg = read_run_checkpoint(source, ["machine.device=cpu"])
    except CheckpointError as exc:
        raise DistillError(f"distill.teacher={source}: {exc} (a weights file needs distill.teacher_trunk=ARCH)"
                           ) from None
    model = rebuild(cfg, checkpoint_channels(state["model"]))
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if missing or unexpected:
        raise DistillError(f"distill.teacher={source}: the checkpoint {path} does not fit the model its config "
                           f"describes (missing {list(missing)[:4]}, unexpected {list(unexpected)[:4]})")
    trunk = getattr(model, "teacher_trunk", None) or model.trunk
    head = getattr(model, "teacher_head", None) if hasattr(model, "teacher_trunk") else getattr(model, "head", None)
    head = head if isinstance(head, DINOHead) else None
    patch_head = getattr(model, "teacher_patch_head", None)
    if patch_head is None and hasattr(model, "patch_head") and head is not None:
        patch_head = head  # iBOT / DINOv2 / DINOv3 with one shared head
    logger.info("distill.teacher: %s (%s run, its %s; DINO head: %s, iBOT head: %s)", path, cfg.method.name,
                "EMA teacher" if hasattr(model, "teacher_trunk") else "trunk", head is not None,
                patch_head is not None)
    return FrozenTeacher(trunk, head, patch_head, source=source)


def _teacher_from_timm(path: str, name: str, kwargs: dict[str, Any], in_channels: int) -> FrozenTeacher:
    """A timm architecture ``name`` with the weights of ``path`` (timm's own layout, loaded strictly)."""
    import timm

    try:
        model = timm.create_model(name, pretrained=False, num_classes=0, in_chans=in_channels, **kwargs)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DistillError(f"distill.teacher_trunk=timm:{name}: timm cannot build it ({exc}); give a timm model "
                           "name (timm.list_models()) and its distill.teacher_trunk_kwargs") from None
    try:
        state = read_weights(path, "distill.teacher")
        model.load_state_dict(state, strict=True)
    except WeightsError as exc:
        raise DistillError(str(exc)) from None
    except RuntimeError as exc:
        raise DistillError(f"distill.teacher={path} does not fit distill.teacher_trunk=timm:{name}: "
                           f"{str(exc).splitlines()[-1].strip()[:300]}") from None
    return FrozenTeacher(TimmDense(model), source=path)
