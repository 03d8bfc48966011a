"""The model pipeline of a run: the model built, frozen, placed, compiled, parallelized, with its loss, optimizer,
schedules, DDP and AMP, in one order (:func:`build_training_model`)."""

from __future__ import annotations

import fnmatch
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

import sslkit.models  # noqa: F401  (registrations)
from sslkit import registry as R
from sslkit.builder.common import section_kwargs, trunk_kwargs
from sslkit.builder.data import TrainData, source_channels
from sslkit.builder.teacher import build_students, load_teacher
from sslkit.config.rules import freeze_entries
from sslkit.config.schema import ConfigError
from sslkit.errors import did_you_mean
from sslkit.methods.distill import student_specs
from sslkit.models.lora import add_lora
from sslkit.models.masking import MaskPlan
from sslkit.models.weights import check_channels, load_backbone, read_weights
from sslkit.optim import OnProgress, build_optimizer, build_schedule, scaled_lr
from sslkit.parallel import parallelize, transformer_blocks

__all__ = ["ModelParts", "build_model", "build_model_as_trained", "build_training_model", "check_external_parts",
           "check_freeze", "compile_parts", "freeze_parameters", "mask_plan", "trunk_arguments"]

logger = logging.getLogger("sslkit")


def compile_parts(model: torch.nn.Module, kinds: tuple[type, ...], backend: str, mode: str) -> list[str]:
    """``machine.compile``: ``torch.compile`` every submodule of ``model`` of a type in ``kinds`` (the trunks and
    heads: students, teachers, key encoders, predictors), in place (``Module.compile``), so parameter names,
    checkpoints, DDP and the hooks that update teachers see the same modules. The method's own wiring (queues,
    shuffles, momentum updates) stays eager: it is small, and Python state there would make dynamo recompile.
    Returns the compiled modules' names."""
    names = [name for name, m in model.named_modules() if isinstance(m, kinds)]
    for name in names:
        model.get_submodule(name).compile(backend=backend, mode=None if mode == "default" else mode)
    logger.info("machine.compile: %d module(s) compiled with torch.compile (backend %s, mode %s): %s; the first "
                "steps are slower while they compile", len(names), backend, mode, ", ".join(names))
    return names


def trunk_arguments(cfg: DictConfig, builder: Any, in_channels: int) -> dict[str, Any]:
    """The trunk builder's arguments: ``model.trunk_kwargs``, and for a builder that takes them the image and patch
    size of the data preset (``data.image_size``, ``data.patch_size``) unless the kwargs give their own."""
    return trunk_kwargs(builder, section_kwargs(cfg.model.trunk_kwargs, ()), in_channels, int(cfg.data.image_size),
                        int(cfg.data.patch_size))


def takes_teacher(model_builder: Any) -> bool:
    """The model builder takes a teacher read from elsewhere (a distillation's): the builder reads and passes it."""
    return "teacher" in inspect.signature(model_builder).parameters


def build_model(cfg: DictConfig, in_channels: int) -> torch.nn.Module:
    """The SSL model the config describes: trunk (``model.trunk``), head (``model.head``) and the method's wiring
    (``model.name``), with fresh weights on the current default device (what training and the evaluation tools
    both build)."""
    import sslkit.methods  # noqa: F401  (registrations)

    model_builder = R.get(R.MODELS, cfg.model.name, "model.name")
    if takes_teacher(model_builder):
        return _build_distill(cfg, in_channels, model_builder)
    builder = R.get(R.TRUNKS, cfg.model.trunk, "model.trunk")
    trunk = builder(**trunk_arguments(cfg, builder, in_channels))
    head_builder = R.get(R.HEADS, cfg.model.head.name, "model.head.name")
    head = head_builder(in_dim=trunk.out_dim, **section_kwargs(cfg.model.head))
    return model_builder(trunk=trunk, head=head, **section_kwargs(cfg.model.kwargs, ()))


def _build_distill(cfg: DictConfig, in_channels: int, model_builder: Any) -> torch.nn.Module:
    """A model with an external teacher (``distill``): the teacher read from ``distill.teacher``, the students built
    from ``distill.students``, the student heads from ``model.head``'s settings."""
    d = cfg.distill
    specs = student_specs(OmegaConf.to_container(d.students, resolve=True))
    size, patch = int(cfg.data.image_size), int(cfg.data.patch_size)
    teacher = load_teacher(d.teacher, d.teacher_trunk, section_kwargs(d.teacher_trunk_kwargs, ()), in_channels, size,
                           patch, rebuild=build_model_as_trained)
    students = build_students(specs, in_channels, size, patch)
    return model_builder(teacher=teacher, students=students, objective=str(d.objective),
                         dense=float(d.patch_weight) > 0, head_kwargs=section_kwargs(cfg.model.head),
                         lr_scales={s["name"]: s["lr_scale"] for s in specs}, mask_student=bool(d.mask_student),
                         teacher_blocks=int(d.teacher_blocks), **section_kwargs(cfg.model.kwargs, ()))


def _lora(cfg: DictConfig, model: torch.nn.Module) -> None:
    """``model.lora``: adapters on the trunk (after its released weights are in), the rest of it frozen."""
    lora = cfg.model.lora
    if int(lora.rank) <= 0:
        return
    adapted = add_lora(model, int(lora.rank), lora.alpha, float(lora.dropout), list(lora.targets))
    trained = sum(p.numel() for p in model.trunk.parameters() if p.requires_grad)
    logger.info("model.lora: rank-%d adapters on %d layers of the trunk (%s), %d of its %d parameters trained; its "
                "weights frozen", int(lora.rank), adapted, ", ".join(lora.targets), trained,
                sum(p.numel() for p in model.trunk.parameters()))


def build_model_as_trained(cfg: DictConfig, in_channels: int) -> torch.nn.Module:
    """The model a run's checkpoint holds: :func:`build_model` and, with ``model.lora``, its adapters (what the
    checkpoint's names are)."""
    model = build_model(cfg, in_channels)
    _lora(cfg, model)
    return model


def freeze_parameters(model: torch.nn.Module, entries: list[tuple[str, str | None, int]]
                      ) -> tuple[list[str], list[tuple[list[str], str, int]]]:
    """``model.freeze``: the parameters an entry freezes for the whole run get ``requires_grad=False`` now (so no
    optimizer, weight decay or DDP reduction sees them); those frozen for the first N updates or epochs are
    returned for :class:`~sslkit.hooks.freeze.FreezeParametersHook`. Returns ``(frozen names, [(names, unit, n)])``.
    A glob that matches no trainable parameter raises :class:`ConfigError` naming the nearest names."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    now: list[str] = []
    later: list[tuple[list[str], str, int]] = []
    params = dict(model.named_parameters())
    for i, (glob, unit, n) in enumerate(entries):
        matched = fnmatch.filter(names, glob)
        if not matched:
            prefix = glob.split("*")[0].rsplit(".", 1)[0]
            near = [n for n in names if n.startswith(prefix)][:6] or names[:6]
            raise ConfigError(f"'model.freeze[{i}]' = {glob} matches no parameter of the "
                              f"model.{did_you_mean(glob, names)} Parameters are named like {', '.join(near)} "
                              "(model.named_parameters())")
        if unit is None:
            for name in matched:
                params[name].requires_grad_(False)
            now += matched
        elif n > 0:
            later.append((matched, unit, n))
    return now, later


def check_freeze(cfg: DictConfig, in_channels: int = 3) -> None:
    """``model.freeze``'s globs against the model's parameters before a run writes anything (the launcher calls
    this after validation, which never builds a model): the model is built on the ``meta`` device (no memory, no
    weights) and :func:`freeze_parameters` raises what it would raise at build time. A model that cannot be built
    on ``meta`` is checked when it is built for real."""
    entries = freeze_entries(cfg.model.freeze)
    if not entries:
        return
    try:
        with torch.device("meta"):
            model = build_model(cfg, in_channels)
    except Exception:
        return
    freeze_parameters(model, entries)


def check_external_parts(cfg: DictConfig) -> None:
    """A model with parts read from elsewhere (a distillation's teacher) built once on the CPU before a run writes
    anything (the launcher calls this after validation): what cannot be read or does not fit (the teacher's file,
    its architecture and channels, a student without a feature map, patches that cannot match) is said with
    nothing written. The teacher is read twice on a fresh start (here, then by the run). So is ``model.pretrained``,
    whose patch embedding must fit the data's channels by ``model.pretrained_channels``' rule."""
    if takes_teacher(R.get(R.MODELS, cfg.model.name, "model.name")):
        build_model(cfg, source_channels(cfg))
    if cfg.model.pretrained:  # a file whose channels the rule cannot fit to the data's: said before the run folder
        state = read_weights(str(cfg.model.pretrained))
        patch = state.get("patch_embed.proj.weight")
        if patch is not None and patch.dim() == 4:
            check_channels(int(patch.shape[1]), source_channels(cfg), str(cfg.model.pretrained_channels),
                           f"model.pretrained={cfg.model.pretrained}")


def mask_plan(cfg: DictConfig, trunk: torch.nn.Module) -> MaskPlan | None:
    """``masking``: the mask stage of the run (:class:`~sslkit.models.masking.MaskPlan`), or None without masks."""
    m = cfg.masking
    if m.name in (None, "none"):
        return None
    generator = R.get(R.MASKINGS, m.name, "masking.name")(**section_kwargs(m, ("name", "views")))
    views = list(m.views) if m.views is not None else None
    plan = MaskPlan(generator, int(trunk.patch_size), int(cfg.seed), views)  # type: ignore[arg-type]
    logger.info("masking: %s (%s), drawn on the device per sample", m.name, plan)
    return plan



@dataclass
class ModelParts:
    """What the model pipeline hands the task: the model as trained (wrapped), its trunk, loss, optimizer,
    schedules and AMP settings, and the parameters ``model.freeze`` froze."""

    model: torch.nn.Module
    trunk: torch.nn.Module
    loss: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_schedule: Any
    wd_schedule: Any
    amp_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler | None
    #: names frozen for the whole run; ``(names, unit, n)`` frozen for the first n updates or epochs
    frozen_now: list[str]
    frozen_later: list[tuple[list[str], str, int]]
    #: parameters sharded by FSDP2 (several processes with ``distributed.strategy=fsdp``)
    fsdp: bool


def build_training_model(cfg: DictConfig, data: TrainData, device: torch.device, world: int) -> ModelParts:
    """The model pipeline, in this order (each step needs the one before it):

    1. build the model with fresh weights (``model.pretrained``: a released backbone into the trunk and its
       teachers) and freeze ``model.freeze``'s parameters (no optimizer, weight decay or
       reduction sees them);
    2. move it to the device; ``machine.channels_last`` (not under FSDP2, which shards contiguous parameters);
    3. ``machine.compile``: the trunks and heads, in place (under FSDP2: per block, in step 5);
    4. ``distributed.sync_bn`` with several processes;
    5. parallelize: activation checkpointing, per-block compile, FSDP2 sharding (:func:`sslkit.parallel.parallelize`);
    6. the loss on the device (told the epoch length for schedules in epochs);
    7. the optimizer, on the parameters as they are now (sharded ones under FSDP2), and the lr and weight-decay
       schedules;
    8. DDP with several processes and no FSDP2 (after the optimizer saw the plain parameters; teachers, without
       gradients, get no reduction);
    9. AMP: the autocast dtype and, for float16, a GradScaler.
    """
    model: torch.nn.Module = build_model(cfg, getattr(data.source, "channels", 3))
    if cfg.model.pretrained:
        load_backbone(model, str(cfg.model.pretrained), str(cfg.model.pretrained_channels),
                      bool(cfg.model.pretrained_partial))
    _lora(cfg, model)
    trunk, head = model.trunk, getattr(model, "head", None)
    frozen_now, frozen_later = freeze_parameters(model, freeze_entries(cfg.model.freeze))
    model = model.to(device)
    fsdp = cfg.distributed.strategy == "fsdp" and world > 1
    if cfg.machine.channels_last and not fsdp:
        model = model.to(memory_format=torch.channels_last)
    if cfg.distributed.strategy == "fsdp" and world == 1:
        logger.info("distributed.strategy=fsdp with one process: nothing to shard, the model is trained whole "
                    "(its checkpoints load into fsdp runs of any size)")
    model = _compile_and_parallelize(cfg, model, (trunk, head), device, world, fsdp)
    _shard_teacher(cfg, model, device, world, fsdp)
    loss = R.get(R.LOSSES, cfg.loss.name, "loss.name")(**section_kwargs(cfg.loss)).to(device)
    if hasattr(loss, "set_epoch_length"):  # schedules a loss takes in epochs (DINO's teacher temperature warm-up)
        loss.set_epoch_length(data.steps_per_epoch)
    optimizer, lr_schedule, wd_schedule = _optimizer(cfg, model, data)
    if world > 1 and not fsdp:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None,
            bucket_cap_mb=cfg.distributed.bucket_cap_mb,
            find_unused_parameters=cfg.distributed.find_unused_parameters,
        )
    amp_dtype = None
    scaler = None
    if cfg.amp.enabled:
        amp_dtype = torch.bfloat16 if cfg.amp.dtype == "bfloat16" else torch.float16
        if amp_dtype == torch.float16:
            scaler = torch.amp.GradScaler(device.type)
    return ModelParts(model, trunk, loss, optimizer, lr_schedule, wd_schedule, amp_dtype, scaler, frozen_now,
                      frozen_later, fsdp)


def _compile_and_parallelize(cfg: DictConfig, model: torch.nn.Module, parts: tuple[Any, Any], device: torch.device,
                             world: int, fsdp: bool) -> torch.nn.Module:
    """Steps 3 to 5 of :func:`build_training_model`: compile, sync BN, parallelize."""
    per_block_compile = cfg.machine.compile and fsdp  # FSDP units are blocks: compile those, inside them
    if cfg.machine.compile and not per_block_compile:
        own = getattr(model, "compiled_kinds", None)  # a model of several trunks (distillation) names its own
        kinds = own() if callable(own) else tuple(t for t in (type(parts[0]), type(parts[1]))
                                                  if t not in (type(None), torch.nn.Identity))
        compile_parts(model, kinds, cfg.machine.compile_backend, cfg.machine.compile_mode)
        teacher = getattr(model, "teacher", None)  # a distillation's frozen teacher, outside the module tree
        if teacher is not None:
            teacher.trunk.compile(backend=cfg.machine.compile_backend,
                                  mode=None if cfg.machine.compile_mode == "default" else cfg.machine.compile_mode)
    if cfg.distributed.sync_bn and world > 1:
        from sslkit.models.sync_batchnorm import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, device)
    if cfg.model.activation_checkpointing or fsdp:
        # activation checkpointing, per-block compile, FSDP2: in that order, before the optimizer sees the parameters
        compile_kwargs = ({"backend": cfg.machine.compile_backend,
                           "mode": None if cfg.machine.compile_mode == "default" else cfg.machine.compile_mode}
                          if per_block_compile else None)
        param_dtype = torch.bfloat16 if cfg.amp.enabled and cfg.amp.dtype == "bfloat16" else None
        model = parallelize(model, strategy=cfg.distributed.strategy, device=device, world_size=world,
                            activation_checkpointing=cfg.model.activation_checkpointing,
                            compile_kwargs=compile_kwargs, param_dtype=param_dtype)
    return model


def _shard_teacher(cfg: DictConfig, model: torch.nn.Module, device: torch.device, world: int, fsdp: bool) -> None:
    """``distill.teacher_shard``: under FSDP2 a distillation's ViT teacher sharded over the processes like the
    students (``auto``, ``true``; each block a unit, then the trunk), else replicated whole on each (``false``,
    DDP, one process, a CNN teacher under ``auto``)."""
    teacher = getattr(model, "teacher", None)
    setting = str(cfg.distill.teacher_shard).lower()
    if teacher is None or setting == "false" or not fsdp:
        return
    blocks = transformer_blocks(teacher.trunk)
    if not blocks:
        if setting == "true":
            raise ConfigError(f"distill.teacher_shard=true: the teacher ({type(teacher.trunk).__name__}) has no "
                              "transformer blocks to shard; set distill.teacher_shard=auto (replicated)")
        return
    param_dtype = torch.bfloat16 if cfg.amp.enabled and cfg.amp.dtype == "bfloat16" else None
    parallelize(teacher.trunk, strategy="fsdp", device=device, world_size=world, param_dtype=param_dtype)
    logger.info("distill.teacher_shard: the teacher's %d blocks sharded over %d processes", len(blocks), world)


def _optimizer(cfg: DictConfig, model: torch.nn.Module, data: TrainData) -> tuple[torch.optim.Optimizer, Any, Any]:
    """Step 7 of :func:`build_training_model`: the optimizer (lr scaled with the global batch), the lr schedule with
    its warm-up, and the weight-decay schedule (a constant one too: it is set and logged at every update)."""
    o = cfg.optim
    lr = scaled_lr(o.lr, data.global_batch, o.lr_scaling)
    try:
        optimizer = build_optimizer(model, o.name, lr, weight_decay=o.weight_decay, momentum=o.momentum,
                                    nesterov=o.nesterov, betas=tuple(o.betas), eta=o.eta,
                                    exclude_bias_and_norm=o.exclude_bias_and_norm, layer_decay=o.layer_decay,
                                    patch_embed_lr_mult=o.patch_embed_lr_mult, trunk_lr_mult=o.trunk_lr_mult)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    warmup = min(o.warmup_epochs * data.steps_per_epoch / data.max_steps, 0.999)
    lr_schedule = OnProgress(build_schedule(o.schedule, lr, o.final_lr, warmup_fraction=warmup))
    wd_schedule = OnProgress(build_schedule("cosine", o.weight_decay, o.final_weight_decay)
                             if o.final_weight_decay is not None else build_schedule("constant", o.weight_decay))
    return optimizer, lr_schedule, wd_schedule
