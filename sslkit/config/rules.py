"""Rules between a config's keys: crops that fit the images and the patches, a batch and a length that make
steps, a trunk that suits the method, masking, the model's parts, hooks, reference sets, and each method's own rules
(:attr:`sslkit.methods.base.Method.rules`) with the sections it owns. The middle layer of validation
(:mod:`sslkit.config.validate`); it never builds a model."""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from sslkit import registry as R
from sslkit.config.schema import ConfigError
from sslkit.config.values import check_kwargs, registered
from sslkit.errors import did_you_mean as _nearest

__all__ = ["REFERENCE_KEYS", "check_builders", "check_freeze", "check_method_rules", "check_run_length",
           "check_sections", "freeze_entries", "per_process_batch"]


def _origin(section: DictConfig, key: str, path: str) -> str:
    """The key to set to change ``path``: the target of a plain ``${other.key}`` interpolation, else ``path``."""
    if key in section and OmegaConf.is_interpolation(section, key):
        match = re.fullmatch(r"\$\{([\w.]+)\}", str(section._get_node(key)._value()))  # type: ignore[union-attr]
        if match:
            return match.group(1)
    return path


def _check_transform_fits(cfg: DictConfig, where: str, splits: tuple[str, ...], errors: list[str]) -> None:
    """Crops of the transform at ``where`` must fit the images of ``splits``' sources (where their size is
    known), local crops must not exceed the global ones, an eval crop must fit its ``resize``, and
    ``mean``/``std`` must have one value or one per channel."""
    from sslkit.data.sources import source_shape

    section = OmegaConf.select(cfg, where)
    shapes = []
    for split in splits:
        name = cfg.data[split].source or cfg.data.train.source
        try:
            kwargs = OmegaConf.to_container(cfg.data[split].kwargs, resolve=True)
            shapes.append((split, name, source_shape(str(name), kwargs)))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue  # a bad source kwarg: reported by the kwargs check or at build time
    sizes = {k: section[k] for k in ("image_size", "small_size", "resize") if isinstance(section.get(k), int)}
    resize = sizes.get("resize")
    for key in ("image_size", "small_size"):
        if key not in sizes:
            continue
        path, value = f"{where}.{key}", sizes[key]
        origin = _origin(section, key, path)
        if resize is not None and key == "image_size":
            if value > resize:
                errors.append(f"'{origin}' = {value}: the centre crop of {where} must fit the image resized to "
                              f"'{where}.resize' = {resize}. Set {origin} <= {resize} or resize >= {value}.")
            continue
        for split, name, shape in shapes:
            if shape.image_size is not None and value > shape.image_size:
                side = shape.image_size
                errors.append(f"'{origin}' = {value}: a crop larger than the {side}x{side} images of the "
                              f"{split} split (source {name}) does not fit the image. Set {origin} <= {side}.")
                break
        else:
            if key == "small_size" and "image_size" in sizes and value > sizes["image_size"]:
                errors.append(f"'{origin}' = {value}: the local crops ({path}) must not be larger than the global "
                              f"crops ({where}.image_size = {sizes['image_size']}). Set {origin} <= "
                              f"{sizes['image_size']}.")
    for key in ("mean", "std"):
        values = section.get(key)
        if not isinstance(values, ListConfig):
            continue
        for split, name, shape in shapes:
            if shape.channels is not None and len(values) not in (1, shape.channels):
                stats = cfg.data.get("stats")
                origin = f" (from data.stats={stats}: statistics of other images)" if stats else ""
                errors.append(f"'{where}.{key}' has {len(values)} values{origin} but the images of the {split} split "
                              f"(source {name}) have {shape.channels} channel(s): give one value, or one per channel"
                              f"{'; compute them on these images with sslkit data stats' if stats else ''}.")
                break


def per_process_batch(cfg: DictConfig, world: int) -> int:
    """The images one process takes per micro-batch: ``data.global_batch_size / (world x optim.micro_batches)``
    when a global batch is set (it must divide; :func:`compose_config` says so), else ``data.batch_size``."""
    g = cfg.data.global_batch_size
    return g // (world * cfg.optim.micro_batches) if g > 0 else cfg.data.batch_size


def _global_batch_errors(cfg: DictConfig) -> list[str]:
    """``data.global_batch_size`` must split evenly over the processes and micro-batches."""
    g, world, acc = cfg.data.global_batch_size, _world_size(cfg), cfg.optim.micro_batches
    per = world * acc
    if g <= 0 or acc < 1 or g % per == 0:
        return []
    lower, higher = g // per * per, -(-g // per) * per
    options = " or ".join(str(v) for v in dict.fromkeys((lower, higher)) if v > 0)
    return [f"'data.global_batch_size' = {g} does not split over {world} process(es) x optim.micro_batches={acc} "
            f"= {per} micro-batches: set it to a multiple of {per} ({options}), or change the number of processes "
            "or optim.micro_batches"]


def _world_size(cfg: DictConfig) -> int:
    """The processes of the run: torchrun's ``WORLD_SIZE``, else ``nproc_per_node`` x ``num_nodes``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return cfg.distributed.nproc_per_node * cfg.distributed.num_nodes


def _check_steps(cfg: DictConfig, errors: list[str]) -> int | None:
    """With a known number of training samples (``data.limit`` or a source that knows its size), at least one
    optimizer step per epoch must fit. Returns the run's steps when they are known here, else None."""
    from sslkit.data.sources import source_shape

    try:
        kwargs = OmegaConf.to_container(cfg.data.train.kwargs, resolve=True)
        n = source_shape(str(cfg.data.train.source), kwargs, "train").num_samples  # type: ignore[arg-type]
    except (TypeError, ValueError):
        n = None
    limit = cfg.data.limit
    if limit > 0:
        n = limit if n is None else min(n, limit)
    if not n:
        return cfg.optim.max_steps or None
    acc, world = cfg.optim.micro_batches, _world_size(cfg)
    b = per_process_batch(cfg, world)
    drop = cfg.data.drop_last
    per_rank = n // world if drop else -(-n // world)
    batches = per_rank // b if drop else -(-per_rank // b)
    if batches // acc == 0:
        where = "data.limit" if limit > 0 and limit == n else "data.train.kwargs.num_samples"
        key = "data.global_batch_size" if cfg.data.global_batch_size > 0 else "data.batch_size"
        errors.append(f"'{key}' = {cfg.data[key.split('.')[1]]}: a step takes {b} x {world} process(es) x "
                      f"optim.micro_batches={acc} = {b * world * acc} samples, more than the {n} training samples "
                      f"({where}={n}): no optimizer step would run. Lower {key} or raise {where}.")
        return None
    return cfg.optim.max_steps or cfg.optim.epochs * (batches // acc)


def check_run_length(cfg: DictConfig, errors: list[str]) -> tuple[bool, int | None]:
    """The processes, the run's length, the decoding, the batch: whether the batch makes steps (so the method's
    rules can see the run's shape) and, when the data's size is known here, the run's steps."""
    d = cfg.distributed
    if not 0 <= d.node_rank < d.num_nodes:
        errors.append(f"'distributed.node_rank' must be in [0, num_nodes={d.num_nodes}), got {d.node_rank}")
    if cfg.optim.epochs == 0 and cfg.optim.max_steps == 0:
        errors.append("'optim.epochs' and 'optim.max_steps' are both 0: set one of them > 0")
    if cfg.data.decode_on == "device" and cfg.data.augment_on == "workers":
        errors.append("'data.decode_on' = device needs the augmentation on the device too (data.augment_on="
                      "workers): set data.augment_on=device or auto, or data.decode_on=auto")
    if cfg.data.order == "shards" and (cfg.data.train.source != "webdataset" or cfg.data.limit):
        errors.append(f"'data.order' = shards reads a sharded source shard by shard, and data.train.source="
                      f"{cfg.data.train.source}{' with data.limit' if cfg.data.limit else ''} has no shards to follow: "
                      "use data.order=random (or data=webdataset)")
    global_batch = _global_batch_errors(cfg)
    errors.extend(global_batch)
    shaped = cfg.data.batch_size > 0 and cfg.optim.micro_batches >= 1 and not global_batch
    return shaped, _check_steps(cfg, errors) if shaped else None


def check_method_rules(cfg: DictConfig, errors: list[str], steps: int | None) -> None:
    """The method's own rules (:attr:`sslkit.methods.base.Method.rules`, such as DINOv2's Sinkhorn-Knopp batch or
    DINOv3's Gram settings), on the run's shape as plain values (``steps``: the run's, when known), with the config
    sections the method owns (:attr:`~sslkit.methods.base.Method.sections`)."""
    from sslkit.methods.base import RunShape

    method = R.METHODS.get(cfg.method.name) if cfg.method.name in R.METHODS else None
    if method is None or not method.rules or not isinstance(cfg.loss, DictConfig):
        return
    world = _world_size(cfg)
    kwargs = cfg.model.kwargs if isinstance(cfg.model.kwargs, DictConfig) else OmegaConf.create({})
    hooks = {name: _plain(h) for name, h in cfg.method.hooks.items() if isinstance(h, DictConfig)}
    sections = {path: _plain_value(OmegaConf.select(cfg, path)) for path in method.sections}
    transform = cfg.data.transform if isinstance(cfg.data.transform, DictConfig) else OmegaConf.create({})
    shape = RunShape(per_process_batch(cfg, world), world, _plain(cfg.loss), _plain(kwargs), hooks, steps,
                     sections=sections, trunk=cfg.model.trunk, transform=_plain(transform), hires=_plain(cfg.hires))
    for rule in method.rules:
        errors.extend(rule(shape))


def _plain_value(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value


def _check_owned_sections(cfg: DictConfig, defaults: DictConfig, errors: list[str]) -> None:
    """The config a method declares its own (:attr:`~sslkit.methods.base.Method.sections`) keeps its defaults in a
    run of another method: a key set there would be read by nothing."""
    owners: dict[str, list[str]] = {}
    for name, method in R.METHODS:
        for path in method.sections:
            owners.setdefault(path, []).append(name)
    for path, names in owners.items():
        if cfg.method.name in names:
            continue
        value, default = OmegaConf.select(cfg, path), OmegaConf.select(defaults, path)
        if isinstance(value, DictConfig) and isinstance(default, DictConfig):
            changed = [f"{path}.{k}" for k, v in value.items() if v != default.get(k)]
        else:
            changed = [path] if _plain_value(value) != _plain_value(default) else []
        if changed:
            readers = " or ".join(f"method.name={n}" for n in sorted(names))
            errors.append(f"'{changed[0]}' is set, but method.name={cfg.method.name} does not read it: the {path} "
                          f"keys are read by {readers} only; drop them, or train a recipe of that method")


def _plain(section: DictConfig) -> dict[str, Any]:
    plain = OmegaConf.to_container(section, resolve=True)
    return plain if isinstance(plain, dict) else {}


def _check_transform(cfg: DictConfig, where: str, builder: Callable[..., Any], errors: list[str]) -> None:
    """Build the transform at ``where`` (cheap: no data) so its own argument checks run now, then check
    that its crops fit the images and, for the training transform under ``data.augment_on=device``, that
    it has a device version."""
    before = len(errors)
    try:
        kwargs = OmegaConf.to_container(OmegaConf.select(cfg, where), resolve=True)
        assert isinstance(kwargs, dict)
        transform = builder(**{k: v for k, v in kwargs.items() if k != "name"})
    except Exception as exc:  # the transform's own message names the argument
        kind = "" if isinstance(exc, ValueError) else f" ({type(exc).__name__})"
        errors.append(f"'{where}'{kind}: {exc}")
    if len(errors) == before:
        splits = ("train",) if where == "data.transform" else ("train", "test")
        _check_transform_fits(cfg, where, splits, errors)
    if len(errors) == before and where == "data.transform" and cfg.data.augment_on == "device":
        _check_device_augment(cfg, transform, errors)


def _check_device_augment(cfg: DictConfig, transform: Any, errors: list[str]) -> None:
    """``data.augment_on=device``: the training transform has a device version."""
    from sslkit.data.device_augment import device_augment_for

    try:
        device_augment_for(transform)
    except ValueError as exc:
        errors.append(f"'data.augment_on' = device with data.transform.name={cfg.data.transform.name}: {exc}")


def check_sections(cfg: DictConfig, ref: DictConfig, trunk: Any, steps: int | None, errors: list[str]) -> None:
    """The hooks, the sections a method owns, the reference sets, a high-resolution phase and the recipe's required
    keys."""
    _check_hooks(cfg, errors)
    _check_owned_sections(cfg, ref, errors)
    _check_reference(cfg, errors)
    _check_phase(cfg, trunk, steps, errors)
    _check_required(cfg, errors)


#: The keys of one ``eval.reference.sets`` entry (read by :func:`sslkit.builder.data.reference_sets`).
REFERENCE_KEYS = ("name", "source", "path", "kwargs", "split", "classes", "samples")


def _check_reference(cfg: DictConfig, errors: list[str]) -> None:
    """``eval.reference.sets``: mappings with a distinct ``name`` each, known keys, a registered source, a split
    and whole numbers where they go; ``data.classes`` as label ids."""
    entries = OmegaConf.to_container(cfg.eval.reference.sets, resolve=True) or []
    names: list[str] = []
    for i, entry in enumerate(entries):  # type: ignore[arg-type]
        where = f"eval.reference.sets[{i}]"
        if not isinstance(entry, dict) or not entry.get("name"):
            errors.append(f"'{where}' = {entry}: each reference set is a mapping with a name, e.g. {{name: old, "
                          "classes: [0, 1, 2, 3, 4]}")
            continue
        if entry["name"] in names:
            errors.append(f"'{where}': the name {entry['name']} is given twice; each set needs its own")
        names.append(entry["name"])
        for key in entry:
            if key not in REFERENCE_KEYS:
                errors.append(f"'{where}.{key}' is not a reference set's key.{_nearest(str(key), REFERENCE_KEYS)} "
                              f"The keys: {', '.join(REFERENCE_KEYS)}")
        split = entry.get("split", "test")
        run_source = cfg.data[split].source if split in ("train", "test") else None
        source = entry.get("source") or run_source or cfg.data.train.source
        # the run's own source is checked as data.<split>.source: said once
        builder = registered(errors if entry.get("source") else [], R.DATASETS, source, f"{where}.source")
        if builder is not None and isinstance(entry.get("kwargs"), dict):
            check_kwargs(f"{where}.kwargs", builder, entry["kwargs"], errors)
        if split not in ("train", "test"):
            errors.append(f"'{where}.split' = {entry['split']}: use train or test")
        if not isinstance(entry.get("samples", 0), int) or entry.get("samples", 0) < 0:
            errors.append(f"'{where}.samples' = {entry['samples']}: a whole number >= 0 (0: all)")
        if not _label_ids(entry.get("classes", [])):
            errors.append(f"'{where}.classes' = {entry['classes']}: a list of label ids, e.g. [0, 1, 2]")
    if not _label_ids(OmegaConf.to_container(cfg.data.classes) if isinstance(cfg.data.classes, ListConfig) else
                      cfg.data.classes):
        errors.append(f"'data.classes' = {cfg.data.classes}: a list of label ids, e.g. [0, 1, 2, 3, 4] ([]: all)")


def _label_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value)


def _check_required(cfg: DictConfig, errors: list[str]) -> None:
    """Every key of ``required`` (what a recipe cannot have a default for) is given."""
    for key in cfg.required:
        if OmegaConf.select(cfg, str(key), default=None) is None:
            errors.append(f"'{key}' must be given: the recipe (config=...) lists it in 'required', it has no default "
                          f"(its recipe file says what it takes); add {key}=... to the command")


def _check_phase(cfg: DictConfig, trunk: Any, steps: int | None, errors: list[str]) -> None:
    """``hires.*`` is a phase a ViT can run (:func:`~sslkit.data.resolution.phase_errors`), in the loader workers."""
    from sslkit.data.resolution import phase_errors

    h = cfg.hires
    if h.start_step is None or trunk is None:
        return
    errors.extend(phase_errors(h.start_step, list(h.global_sizes), list(h.local_sizes), list(h.teacher_sizes),
                               list(h.ratios), _patch_size(cfg, trunk), steps))
    if cfg.data.augment_on == "device":
        errors.append("'hires.start_step' is set with data.augment_on=device: the crops of a high-resolution phase "
                      "are made in the loader workers (the device augmentation has one size per view): set "
                      "data.augment_on=workers or auto")


def check_builders(cfg: DictConfig, errors: list[str]) -> Any:
    """The registered names and their builders' arguments: the train step, the transforms, the head, the loss, the
    model, the trunk (with its own checks, the pretrained weights and the distributed strategy), the masking and
    the data sources. Returns the trunk's builder (None when it is not registered)."""
    registered(errors, R.TRAIN_STEPS, cfg.train_step, "train_step")
    for where, reg, section in (("data.transform", R.TRANSFORMS, cfg.data.transform),
                                ("data.eval_transform", R.TRANSFORMS, cfg.data.eval_transform),
                                ("model.head", R.HEADS, cfg.model.head), ("loss", R.LOSSES, cfg.loss)):
        if not isinstance(section, DictConfig):
            errors.append(f"'{where}' must be a section (dict; {{}} for none), got {section!r}")
            continue
        if "name" not in section:
            errors.append(f"'{where}' needs a 'name'")
            continue
        builder = registered(errors, reg, section.name, where + ".name")
        if builder is None:
            continue
        before = len(errors)
        check_kwargs(where, builder, {k: v for k, v in section.items() if k != "name"}, errors)
        if reg is R.TRANSFORMS and len(errors) == before:
            _check_transform(cfg, where, builder, errors)
        if reg is R.LOSSES:
            _check_loss_call(section.name, builder, errors)
    model = registered(errors, R.MODELS, cfg.model.name, "model.name")
    if model is not None:
        check_kwargs("model.kwargs", model, dict(cfg.model.kwargs), errors)
    trunk = registered(errors, R.TRUNKS, cfg.model.trunk, "model.trunk")
    if trunk is not None:
        check_kwargs("model.trunk_kwargs", trunk, dict(cfg.model.trunk_kwargs), errors)
        _check_trunk(cfg, trunk, errors)
        _check_pretrained(cfg, trunk, errors)
        _check_lora(cfg, errors)
        _check_strategy(cfg, trunk, errors)
    _check_masking(cfg, trunk, errors)
    for split in ("train", "test"):
        source = cfg.data[split].source or cfg.data.train.source
        builder = registered(errors, R.DATASETS, source, f"data.{split}.source")
        if builder is not None:
            check_kwargs(f"data.{split}.kwargs", builder, dict(cfg.data[split].kwargs), errors)
    return trunk


def _check_loss_call(name: str, builder: Any, errors: list[str]) -> None:
    """sslkit calls every loss one way, ``loss(output, sample, ctx)`` (``ctx``: the step context, with the training
    clock): a registered loss module whose ``forward`` cannot take the third argument is a config error, said here
    rather than at the first step."""
    forward = getattr(builder, "forward", None) if inspect.isclass(builder) else None
    if forward is None:
        return
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        errors.append(f"'loss.name' = {name}: {builder.__name__}.forward takes ({', '.join(p.name for p in params)}), "
                      "but sslkit calls every loss as loss(output, sample, ctx) (ctx: the step context, with the "
                      "training clock): add a third argument, ctx=None")


def _crop_sizes(cfg: DictConfig) -> list[tuple[str, int]]:
    """Every crop size the run feeds its trunk, with the key to set to change it: the training transform's
    sizes (``image_size``, a multi-crop's ``small_size`` when it has small crops) and the evaluation's."""
    sizes: list[tuple[str, int]] = []
    for where in ("data.transform", "data.eval_transform"):
        section = OmegaConf.select(cfg, where)
        if not isinstance(section, DictConfig):
            continue
        for key in ("image_size", "small_size", "teacher_size"):
            if key == "small_size" and section.get("num_small", 1) == 0:
                continue
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                sizes.append((_origin(section, key, f"{where}.{key}"), value))
    return list(dict.fromkeys(sizes))


def _check_pretrained(cfg: DictConfig, trunk: Any, errors: list[str]) -> None:
    """``model.pretrained``: a file that exists, of a kind the loader reads, or a transformers folder, for a ViT
    trunk (whether its network is the trunk's is checked when it is read, before the first step)."""
    path = cfg.model.pretrained
    if path is None:
        return
    file = Path(str(path)).expanduser()
    if not getattr(trunk, "patch_tokens", False):
        errors.append(f"'model.pretrained' loads ViT backbones (sslkit's ViTs, timm's DINOv3 ViTs), and "
                      f"model.trunk={cfg.model.trunk} is none: use a ViT trunk or drop model.pretrained")
    elif file.is_dir() and (file / "config.json").is_file():
        return  # a transformers checkpoint folder: what it holds is checked when it is read
    elif not file.is_file():
        what = "is a folder without a config.json" if file.exists() else "does not exist"
        errors.append(f"'model.pretrained' = {path}: {what}; give the .pth or .safetensors file of the backbone, "
                      "or a transformers folder (config.json + model.safetensors)")
    elif file.suffix not in (".pth", ".pt", ".safetensors", ".bin"):
        errors.append(f"'model.pretrained' = {path}: not a .pth, .pt, .bin or .safetensors file of weights")


def _check_lora(cfg: DictConfig, errors: list[str]) -> None:
    """``model.lora``: a whole rank >= 0, targets named; not under FSDP2 (peft's layers there are untested)."""
    lora = cfg.model.lora
    rank = lora.rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        errors.append(f"'model.lora.rank' must be a whole number >= 0 (0: off), got {rank!r}")
    elif rank > 0 and not list(lora.targets):
        errors.append("'model.lora.targets' is empty: name the layers to adapt, e.g. [attn.qkv, attn.proj]")
    elif rank > 0 and cfg.distributed.strategy == "fsdp":
        errors.append("'model.lora.rank' > 0 with distributed.strategy=fsdp: LoRA's layers under FSDP2 are not "
                      "tested yet; use distributed.strategy=ddp (the frozen trunk needs no sharded optimizer state)")


def _patch_size(cfg: DictConfig, trunk: Any) -> int | None:
    """The side of a patch trunk's patches (``model.trunk_kwargs.patch_size``, else ``data.patch_size``), or None for
    a trunk without patches or a patch size that is not a positive int (reported by the kwargs check)."""
    if not getattr(trunk, "patch_tokens", False):
        return None
    patch = cfg.model.trunk_kwargs.get("patch_size", cfg.data.patch_size)
    return patch if isinstance(patch, int) and patch > 0 else None


def _check_trunk(cfg: DictConfig, trunk: Any, errors: list[str]) -> None:
    """A trunk's own checks (a ViT's kwargs against timm's), and for a patch trunk that every crop is a whole
    number of patches."""
    check = getattr(trunk, "check_kwargs", None)
    if callable(check):
        errors.extend(check(dict(cfg.model.trunk_kwargs)))
    if getattr(trunk, "patch_tokens", False):
        from sslkit.models.vit import patch_grid_errors

        patch = _patch_size(cfg, trunk)
        if patch is not None:
            errors.extend(patch_grid_errors(patch, _crop_sizes(cfg)))
        from sslkit.models.vit import VIT_SIZES

        depth = cfg.model.trunk_kwargs.get("depth") or VIT_SIZES.get(str(cfg.model.trunk), (0, 0, 0, ""))[1]
        if cfg.eval.vit_features == "cls_last_n" and depth and cfg.eval.vit_last_n > depth:
            errors.append(f"'eval.vit_last_n' = {cfg.eval.vit_last_n}: the ViT has {depth} blocks (model.trunk_kwargs."
                          f"depth), so the CLS tokens of at most its last {depth} can be read")
    else:
        if cfg.eval.vit_features != "pool":
            errors.append(f"'eval.vit_features' = {cfg.eval.vit_features} reads tokens of a ViT, and model.trunk="
                          f"{cfg.model.trunk} has none: use eval.vit_features=pool (the trunk's features)")
        for key in ("layer_decay", "patch_embed_lr_mult"):
            if cfg.optim[key] != 1.0:
                errors.append(f"'optim.{key}' = {cfg.optim[key]} needs a ViT's layers and patch embedding, and "
                              f"model.trunk={cfg.model.trunk} has none: set optim.{key}=1.0 or use a ViT trunk")


def _check_strategy(cfg: DictConfig, trunk: Any, errors: list[str]) -> None:
    """What ``distributed.strategy=fsdp`` and ``model.activation_checkpointing`` need: transformer blocks (a
    ViT trunk), bfloat16 rather than float16, and gradients reduced during backward (docs/distributed.md)."""
    vit = getattr(trunk, "patch_tokens", False)
    if cfg.model.activation_checkpointing and not vit:
        errors.append(f"'model.activation_checkpointing' = true checkpoints transformer blocks, and model.trunk="
                      f"{cfg.model.trunk} has none: set model.activation_checkpointing=false or use a ViT trunk")
    if cfg.distributed.strategy != "fsdp":
        return
    if not vit:
        errors.append(f"'distributed.strategy' = fsdp shards a model one transformer block at a time, and model.trunk="
                      f"{cfg.model.trunk} has none: use distributed.strategy=ddp (a CNN trunk fits on one GPU) or "
                      "a ViT trunk")
    if cfg.amp.enabled and cfg.amp.dtype == "float16":
        errors.append("'amp.dtype' = float16 under distributed.strategy=fsdp: FSDP2 has no gradient scaler for "
                      "sharded gradients here; use amp.dtype=bfloat16 (no scaler needed) or distributed.strategy=ddp")
    if cfg.reliability.oom == "skip":
        errors.append("'reliability.oom' = skip needs the gradients reduced after backward so every rank can drop "
                      "the same step, and FSDP reduces them during backward: use reliability.oom=halt with "
                      "distributed.strategy=fsdp")
    if cfg.distributed.manual_gradient_reduction:
        errors.append("'distributed.manual_gradient_reduction' = true is DDP's option: FSDP reduce-scatters the "
                      "gradients itself; set it to false with distributed.strategy=fsdp")


def _check_masking(cfg: DictConfig, trunk: Any, errors: list[str]) -> None:
    """``masking``: a registered generator with valid arguments, on a trunk with patches, for a method that uses
    masks; a method that needs masks or patch tokens gets them."""
    section = cfg.masking
    if not isinstance(section, DictConfig):
        errors.append(f"'masking' must be a section (dict) with a name, got {section!r}")
        return
    name = section.get("name") or "none"
    method = R.METHODS.get(cfg.method.name) if cfg.method.name in dict(R.METHODS) else None
    patches = trunk is not None and bool(getattr(trunk, "patch_tokens", False))
    cnn = f"model.trunk={cfg.model.trunk} has no patches: use a ViT (model.trunk=vit_tiny, vit_small, ...)"
    if method is not None and method.patch_tokens and trunk is not None and not patches:
        errors.append(f"'model.trunk': method {method.name} reads a ViT's patch tokens, and {cnn}")
    if name == "none":
        if method is not None and method.masking is not None:
            errors.append(f"'masking.name' = none, but method {method.name} trains on masked patches: keep "
                          f"masking.name={method.masking} (or another generator) and tune its keys (docs/vit.md)")
        return
    if method is not None and method.masking is None and not method.takes_masks:
        errors.append(f"'masking.name' = {name}, but method {method.name} does not use masks (its model takes none): "
                      "set masking.name=none, or use a masked method ("
                      f"{', '.join(sorted(n for n, m in R.METHODS if m.masking))})")
    if trunk is not None and not patches:
        errors.append(f"'masking.name' = {name} hides patches, and {cnn}")
    builder = registered(errors, R.MASKINGS, name, "masking.name")
    if builder is None:
        return
    kwargs = {k: v for k, v in section.items() if k not in ("name", "views")}
    before = len(errors)
    check_kwargs("masking", builder, kwargs, errors)
    if len(errors) == before:
        try:
            generator = builder(**OmegaConf.to_container(OmegaConf.create(kwargs), resolve=True))  # type: ignore
        except (ValueError, TypeError) as exc:
            errors.append(f"'masking' ({name}): {exc}")
        else:
            wanted = getattr(R.MASKINGS.get(method.masking)(), "mode", None) if method and method.masking else None
            mode = getattr(generator, "mode", None)
            if wanted is not None and mode is not None and mode != wanted:
                fits = [n for n, b in R.MASKINGS if getattr(b(), "mode", None) == wanted]
                what = {"drop": "drop the masked patches", "drop_padded": "drop the masked patches, padded to a fixed "
                        "count", "replace": "replace the masked patches with the mask token"}
                errors.append(f"'masking.name' = {name}: its masks {what.get(mode, mode)}, and method {method.name} "
                              f"needs masks that {what.get(wanted, wanted)}: use masking.name="
                              f"{' or '.join(sorted(fits))}")
            grid_errors = getattr(generator, "grid_errors", None)
            patch = cfg.model.trunk_kwargs.get("patch_size", cfg.data.patch_size)
            size = OmegaConf.select(cfg, "data.transform.image_size")
            if callable(grid_errors) and patches and isinstance(patch, int) and isinstance(size, int) \
                    and patch > 0 and size >= patch:
                errors.extend(grid_errors((size // patch, size // patch)))
    views = section.get("views")
    if views is not None and (not isinstance(views, ListConfig) or not all(isinstance(v, int) and v >= 0
                                                                           for v in views)):
        errors.append(f"'masking.views' must be a list of view indices (like [0, 1]) or null, got {views!r}")


def freeze_entries(spec: Any) -> list[tuple[str, str | None, int]]:
    """``model.freeze`` as ``(glob, unit, n)``: unit None (the whole run), ``steps`` or ``epochs``. Raises
    :class:`ConfigError` for an entry that is neither a glob nor ``{params: GLOB, steps|epochs: N}``."""
    entries: list[tuple[str, str | None, int]] = []
    if spec is None:
        return entries
    if not isinstance(spec, ListConfig | list):
        raise ConfigError(f"'model.freeze' must be a list of parameter globs (like [trunk.patch_embed.*]), got "
                          f"{spec!r}")
    for i, item in enumerate(spec):
        where = f"model.freeze[{i}]"
        if isinstance(item, str) and item:
            entries.append((item, None, 0))
            continue
        if not isinstance(item, DictConfig | dict) or not isinstance(item.get("params"), str):
            raise ConfigError(f"'{where}' must be a glob (like trunk.patch_embed.*) or {{params: GLOB, steps: N}} / "
                              f"{{params: GLOB, epochs: N}}, got {item!r}")
        extra = set(item.keys()) - {"params", "steps", "epochs"}
        units = [u for u in ("steps", "epochs") if u in item]
        if "updates" in extra:
            raise ConfigError(f"'{where}.updates' was renamed '{where}.steps' (one word for an optimizer step: "
                              "docs/configs.md, Renamed keys)")
        if extra or len(units) > 1:
            raise ConfigError(f"'{where}' takes params and one of steps / epochs, got {sorted(item.keys())}")
        if not units:
            entries.append((item["params"], None, 0))
            continue
        n = item[units[0]]
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"'{where}.{units[0]}' must be an integer >= 0, got {n!r}")
        entries.append((item["params"], units[0], int(n)))
    return entries


def check_freeze(cfg: DictConfig, errors: list[str]) -> None:
    """Every ``model.freeze`` entry is well formed. (That its glob names a parameter of the model is checked where
    the model is built: :func:`sslkit.builder.freeze_parameters`; validation never builds a model.)"""
    try:
        freeze_entries(cfg.model.freeze)
    except ConfigError as exc:
        errors.append(str(exc))


def _check_hooks(cfg: DictConfig, errors: list[str]) -> None:
    """The method exists; its hooks (``method.hooks``) and the added ones (``hooks``) are registered with valid
    arguments; no hook the method requires is dropped; an added hook does not repeat one of the method's."""
    method = registered(errors, R.METHODS, cfg.method.name, "method.name")
    own = cfg.method.hooks
    if not isinstance(own, DictConfig):
        errors.append(f"'method.hooks' must be a dict of hook name -> its kwargs, got {own!r}")
        own = OmegaConf.create({})
    for name, kwargs in own.items():
        where = f"method.hooks.{name}"
        if kwargs is None:
            continue  # dropped on purpose (a required one is reported below)
        if not isinstance(kwargs, DictConfig):
            errors.append(f"'{where}' must be a dict of the hook's kwargs ({{}} for none) or null to drop it, "
                          f"got {kwargs!r}")
            continue
        hook = registered(errors, R.HOOKS, name, where)
        if hook is not None:
            check_kwargs(where, hook, dict(kwargs), errors)
    if method is not None:
        for name in method.required_hooks:
            if own.get(name) is None:
                how = "is set to null" if name in own else "is missing"
                errors.append(f"'method.hooks.{name}' {how}, but method {method.name} cannot train without the "
                              f"{name} hook (it would train silently wrong). Keep it and tune it "
                              f"(method.hooks.{name}.<key>=...); to change what it does, write your own method "
                              "(docs/methods.md).")
    for i, spec in enumerate(cfg.hooks):
        where = f"hooks[{i}]"
        if not isinstance(spec, DictConfig) or "name" not in spec:
            errors.append(f"'{where}' must be a dict with a 'name', got {spec!r}")
            continue
        if own.get(spec.name) is not None:
            errors.append(f"'{where}': {spec.name} is one of the method's hooks already (method.hooks.{spec.name}); "
                          f"tune it there (method.hooks.{spec.name}.<key>=...) instead of adding it twice")
            continue
        hook = registered(errors, R.HOOKS, spec.name, where + ".name")
        if hook is not None:
            check_kwargs(where, hook, {k: v for k, v in spec.items() if k != "name"}, errors)
