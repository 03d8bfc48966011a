"""Validation of a composed config: keys, types, value rules, registered names and builder arguments, and the
cross-field checks (crop sizes, paths, batch and steps, device, trunk, masking, hooks). It never builds a model."""

from __future__ import annotations

import inspect
import math
import os
import re
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from sslkit import registry as R
from sslkit.config.schema import (
    FREE_FORM,
    GROUPS,
    ConfigError,
    flat_keys,
    schema,
)
from sslkit.errors import did_you_mean as _nearest

__all__ = ["REFERENCE_KEYS", "freeze_entries", "per_process_batch", "validate"]

#: Keys that take values of several types; their value rule alone checks them.
_VALUE_RULES_ONLY = {"log.progress_bar", "checkpoint.sharded", "data.num_workers", "data.pin_memory",
                     "eval.monitors.enabled", "eval.knn.subsample", "distill.teacher_shard", "eval.bench.num_workers",
                     "eval.dense.window"}


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number" if not isinstance(value, int) else "int"
    if isinstance(value, str):
        return "str"
    if isinstance(value, ListConfig | list):
        return "list"
    if isinstance(value, DictConfig | dict):
        return "dict"
    return type(value).__name__


def _compatible(expected: Any, got: Any) -> bool:
    e, g = _type_name(expected), _type_name(got)
    return e == g or (e == "number" and g == "int")


def _check_tree(cfg: DictConfig, ref: DictConfig, prefix: str, errors: list[str]) -> None:
    for key in cfg.keys():
        path = f"{prefix}{key}"
        if key not in ref:
            known = [f"{prefix}{k}" for k in ref.keys()] + list(flat_keys(schema()))
            known += [] if prefix else list(GROUPS)  # a misspelt config=/data= group lands here as a key
            errors.append(f"unknown config key '{path}'.{_nearest(path, known)}")
            continue
        value, expected = cfg._get_node(key), ref._get_node(key)
        if path in FREE_FORM:
            continue
        if isinstance(expected, DictConfig):
            if not isinstance(value, DictConfig):
                errors.append(f"'{path}' must be a section (dict), got {_type_name(value)} {value!r}")
            else:
                _check_tree(value, expected, path + ".", errors)
            continue
        exp_v, got_v = ref[key], cfg[key]
        if exp_v is None or got_v is None or path in _VALUE_RULES_ONLY:
            continue
        if not _compatible(exp_v, got_v):
            errors.append(f"'{path}' must be {_type_name(exp_v)} (like {exp_v!r}), got {_type_name(got_v)} {got_v!r}")


def _parameters(builder: Callable[..., Any]) -> Any:
    """The parameters of a registered builder: a class's ``__init__``'s, a function's own."""
    return inspect.signature(builder.__init__ if inspect.isclass(builder) else builder).parameters


def _check_kwargs(where: str, builder: Callable[..., Any], kwargs: dict[str, Any], errors: list[str],
                  provided: tuple[str, ...] = ()) -> None:
    """Every key of ``kwargs`` must be an argument of ``builder``; required ones must be there."""
    params = _parameters(builder)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n in params if n not in ("self",)]
    for key, value in kwargs.items():
        if key not in names:
            errors.append(f"'{where}.{key}' is not an argument of {getattr(builder, '__name__', builder)}."
                          f"{_nearest(key, names)} Its arguments: {', '.join(names)}.")
            continue
        param = params[key]
        hint = param.annotation
        annotation = hint if isinstance(hint, str) else hint.__name__ if isinstance(hint, type) else str(hint)
        if annotation == "None" and value is not None:
            errors.append(f"'{where}.{key}' = {value!r}: {getattr(builder, '__name__', builder)} has no use for it "
                          f"(it is there for the other builders of {where}): set {where}.{key}=null")
        elif _annotation_accepts(annotation, value, none_ok=param.default is None) is False:
            errors.append(f"'{where}.{key}' must be {annotation}, got {_type_name(value)} {value!r}")


def _split_union(annotation: str) -> list[str]:
    """``"float | Sequence[float]"`` -> ``["float", "Sequence[float]"]`` (``|`` inside brackets kept)."""
    parts, depth, current = [], 0, ""
    for ch in annotation:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "|" and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return [*parts, current.strip()]


def _annotation_accepts(annotation: str, value: Any, none_ok: bool = False) -> bool | None:
    """Whether ``value`` fits a builder argument annotated ``annotation`` (a string, as under
    ``from __future__ import annotations``); None when the annotation is not one of the simple kinds
    checked here (int, float, bool, str, None, sequences, mappings)."""
    checks: dict[str, Callable[[Any], bool]] = {
        "None": lambda v: v is None,
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
    }
    sequence = ("Sequence[", "list[", "tuple[", "List[", "Tuple[")
    mapping = ("dict", "Mapping", "Dict")
    if value is None and none_ok:
        return True
    for part in _split_union(annotation):
        if part in checks:
            if checks[part](value):
                return True
        elif part.startswith(sequence) or part in ("list", "tuple"):
            if isinstance(value, ListConfig | list | tuple):
                return True
        elif part.startswith(mapping):
            if isinstance(value, DictConfig | dict):
                return True
        else:
            return None  # Any, a class, a callable...: not checked here
    return False


def _registered(errors: list[str], reg: Any, name: Any, where: str) -> Any:
    try:
        return R.get(reg, str(name), where=where)
    except R.UnknownNameError as exc:
        errors.append(str(exc))
        return None


def _finite(v: Any) -> bool:
    return math.isfinite(v)


def _probability(v: Any) -> bool:
    return 0 <= v <= 1


# value checks: key -> (predicate, requirement)
_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


#: torch.compile's own backends: accepted without importing torch._dynamo (about a second and a half).
_BUILTIN_BACKENDS = ("inductor", "aot_eager", "eager")


def _compile_backends() -> list[str]:
    """The backends torch.compile knows here."""
    import torch._dynamo

    return ["eager", *torch._dynamo.list_backends(exclude_tags=())]


_VALUE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "data.batch_size": (lambda v: v > 0, "> 0"),
    "data.global_batch_size": (lambda v: v >= 0, ">= 0 (0: data.batch_size per process decides)"),
    "data.num_workers": (lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                         "auto or an integer >= 0"),
    "data.pin_memory": (lambda v: v in ("auto", True, False), "auto, true or false"),
    "data.augment_on": (lambda v: v in ("auto", "workers", "device"), "auto, workers or device"),
    "data.order": (lambda v: v in ("random", "shards"), "random or shards"),
    "data.shard_span": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "data.decode_on": (lambda v: v in ("auto", "workers", "device"), "auto, workers or device"),
    "data.limit": (lambda v: v >= 0, ">= 0 (0 = all)"),
    "data.image_size": (lambda v: v > 0, "> 0 (the crop side in pixels)"),
    "data.small_image_size": (lambda v: v > 0, "> 0 (the local crop side in pixels)"),
    "data.min_crop_scale": (lambda v: 0 < v <= 1, "in (0, 1] (an area fraction)"),
    "data.blur_p": (_probability, "a probability in [0, 1]"),
    "data.patch_size": (lambda v: v > 0, "> 0 (a ViT patch's side in pixels)"),
    "optim.layer_decay": (lambda v: 0 < v <= 1, "in (0, 1] (1 = off)"),
    "optim.patch_embed_lr_mult": (lambda v: v > 0 and _finite(v), "> 0 (1 = off)"),
    "optim.trunk_lr_mult": (lambda v: v > 0 and _finite(v), "> 0 (1 = off)"),
    "optim.clip_grad": (lambda v: v >= 0 and _finite(v), ">= 0 (0 = off)"),
    "optim.clip_grad_mode": (lambda v: v in ("global", "per_parameter"), "global or per_parameter"),
    "eval.vit_features": (lambda v: v in ("pool", "cls", "avg", "cls+avg", "cls_last_n"),
                          "pool, cls, avg, cls+avg or cls_last_n"),
    "eval.vit_last_n": (lambda v: v >= 1, ">= 1"),
    "machine.num_threads": (lambda v: v >= 0, ">= 0 (0 = torch's default)"),
    "machine.compile_mode": (lambda v: v in _COMPILE_MODES, " | ".join(_COMPILE_MODES)),
    "machine.compile_backend": (lambda v: v in _BUILTIN_BACKENDS or v in _compile_backends(),
                                "a torch.compile backend: inductor, aot_eager "
                                "or eager (torch._dynamo.list_backends())"),
    "optim.lr": (lambda v: v > 0 and _finite(v), "> 0 and finite"),
    "optim.final_lr": (lambda v: v >= 0 and _finite(v), ">= 0 and finite"),
    "optim.epochs": (lambda v: v >= 0, ">= 0"),
    "optim.max_steps": (lambda v: v >= 0, ">= 0 (0 = epochs decide)"),
    "optim.weight_decay": (lambda v: v >= 0 and _finite(v), ">= 0 and finite"),
    "optim.final_weight_decay": (lambda v: v >= 0 and _finite(v), ">= 0 and finite (or null)"),
    "optim.warmup_epochs": (lambda v: v >= 0, ">= 0"),
    "optim.momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.eta": (lambda v: v > 0, "> 0"),
    "optim.betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    "optim.lr_scaling": (lambda v: v in ("linear", "sqrt", "none"), "one of linear, sqrt, none"),
    "optim.name": (lambda v: v in ("sgd", "lars", "adamw", "adam"), "one of sgd, lars, adamw, adam"),
    "optim.schedule": (lambda v: v in ("cosine", "linear", "constant"), "one of cosine, linear, constant"),
    "machine.device": (lambda v: v in ("auto", "cpu", "cuda") or str(v).startswith("cuda:"),
                       "auto, cpu, cuda or cuda:N"),
    "amp.dtype": (lambda v: v in ("bfloat16", "float16"), "bfloat16 or float16"),
    "checkpoint.every_n_epochs": (lambda v: v >= 0, ">= 0"),
    "checkpoint.every_n_steps": (lambda v: v >= 0, ">= 0"),
    "checkpoint.keep_last": (lambda v: v >= 0, ">= 0 (0 = keep all)"),
    "checkpoint.sharded": (lambda v: v in ("auto", True, False), "auto, true or false"),
    "distill.teacher_shard": (lambda v: v in ("auto", True, False), "auto, true or false"),
    "distill.teacher_blocks": (lambda v: v >= 1, ">= 1 (1: the teacher's final tokens)"),
    "model.pretrained_channels": (lambda v: v in ("fino", "timm", "refuse"), "fino, timm or refuse"),
    "eval.reference.every_n_steps": (lambda v: v >= 0, ">= 0 (0: at the start and the end only)"),
    "eval.reference.k": (lambda v: v >= 1, ">= 1"),
    "eval.reference.temperature": (lambda v: v > 0, "> 0"),
    "eval.reference.warn_drop": (lambda v: 0 < v < 1, "in (0, 1): a fraction of the start"),
    "log.every_n_steps": (lambda v: v > 0, "> 0"),
    "log.progress_bar": (lambda v: v in ("auto", True, False), "auto, true or false"),
    "eval.linear.epochs": (lambda v: v >= 1, ">= 1"),
    "eval.linear.batch_size": (lambda v: v >= 1, ">= 1"),
    "eval.linear.batch_size_features": (lambda v: v >= 1, ">= 1"),
    "eval.linear.lr": (lambda v: v > 0 and _finite(v), "> 0"),
    "eval.linear.momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "eval.linear.weight_decay": (lambda v: v >= 0 and _finite(v), ">= 0"),
    "eval.linear.crop_scale": (lambda v: len(v) == 2 and 0 < v[0] <= v[1] <= 1,
                               "[low, high] with 0 < low <= high <= 1"),
    "eval.finetune.epochs": (lambda v: v >= 1, ">= 1"),
    "eval.finetune.batch_size": (lambda v: v >= 1, ">= 1"),
    "eval.finetune.blr": (lambda v: v > 0 and _finite(v), "> 0 and finite"),
    "eval.finetune.min_lr": (lambda v: v >= 0 and _finite(v), ">= 0 and finite"),
    "eval.finetune.warmup_epochs": (lambda v: v >= 0 and _finite(v), ">= 0 (0 = no warmup)"),
    "eval.finetune.weight_decay": (lambda v: v >= 0 and _finite(v), ">= 0 and finite"),
    "eval.finetune.betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    "eval.finetune.layer_decay": (lambda v: not isinstance(v, bool | str) and 0 < v <= 1,
                                  "in (0, 1] (1 = off), or null (0.75 for a ViT, 1 for a CNN)"),
    "eval.finetune.drop_path": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "eval.finetune.smoothing": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "eval.finetune.head_init_std": (lambda v: v > 0 and _finite(v), "> 0 and finite"),
    "eval.finetune.crop_scale": (lambda v: len(v) == 2 and 0 < v[0] <= v[1] <= 1,
                                 "[low, high] with 0 < low <= high <= 1"),
    "eval.monitors.enabled": (lambda v: v in ("auto", True, False), "auto, true or false"),
    "eval.bench.num_workers": (lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                               "auto or an integer >= 0"),
    "eval.bench.level": (lambda v: isinstance(v, float) and 0.5 <= v < 1.0, "a number in [0.5, 1)"),
    "eval.bench.linear.val_fraction": (lambda v: isinstance(v, float) and 0.0 < v < 1.0, "a number in (0, 1)"),
    "eval.bench.attentive.val_fraction": (lambda v: isinstance(v, float) and 0.0 < v < 1.0, "a number in (0, 1)"),
    "eval.bench.attentive.epochs": (lambda v: v >= 1, ">= 1"),
    "eval.dense.window": (lambda v: v is None or v == "auto" or (isinstance(v, int) and not isinstance(v, bool)
                                                                  and v >= 1), "auto, null or a number of pixels"),
    "eval.dense.dataset": (lambda v: v in ("scenes", "fashion_mnist", "folder"), "scenes, fashion_mnist or folder"),
    "eval.dense.scenes.canvas": (lambda v: v >= 28 and v % 28 == 0, "a multiple of 28 (Fashion-MNIST's side)"),
    "eval.dense.scenes.garments": (lambda v: len(v) == 2 and 1 <= v[0] <= v[1] <= 10,
                                   "[fewest, most] with 1 <= fewest <= most <= 10"),
    "eval.dense.scenes.train": (lambda v: v >= 1, ">= 1"),
    "eval.dense.scenes.test": (lambda v: v >= 1, ">= 1"),
    "eval.monitors.rankme_samples": (lambda v: v >= 2, ">= 2"),
    "eval.monitors.online_linear_lr": (lambda v: v > 0 and _finite(v), "> 0"),
    "eval.knn.k": (lambda v: v > 0, "> 0"),
    "eval.knn.temperature": (lambda v: v > 0 and _finite(v), "> 0"),
    "eval.knn.batch_size": (lambda v: v > 0, "> 0"),
    "eval.knn.every_n_epochs": (lambda v: v >= 0, ">= 0 (0 = only at the end)"),
    "eval.knn.subsample": (lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                           "auto (5000 samples per split on the CPU, all on a GPU), 0 (all) or a number of "
                           "samples"),
    "log.wandb.mode": (lambda v: v in ("auto", "online", "offline"), "auto, online or offline"),
    "distributed.nproc_per_node": (lambda v: v >= 1, ">= 1"),
    "distributed.num_nodes": (lambda v: v >= 1, ">= 1"),
    "distributed.master_port": (lambda v: 0 <= v <= 65535, "a TCP port in [0, 65535] (0 = a free one)"),
    "distributed.backend": (lambda v: v in ("auto", "nccl", "gloo"), "auto, nccl or gloo"),
    "distributed.timeout_s": (lambda v: v > 0, "> 0"),
    "distributed.strategy": (lambda v: v in ("ddp", "fsdp"), "ddp or fsdp"),
    "distributed.bucket_cap_mb": (lambda v: v > 0, "> 0"),
    "distributed.consistency_check_every_n_steps": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "optim.micro_batches": (lambda v: v >= 1, ">= 1"),
    "reliability.nonfinite_loss": (lambda v: v in ("halt", "skip"), "halt or skip"),
    "reliability.oom": (lambda v: v in ("halt", "skip"), "halt or skip"),
    "reliability.max_consecutive_skips": (lambda v: v >= 1, ">= 1"),
    "reliability.preemption_signals": (
        lambda v: all(isinstance(x, str) and x.startswith("SIG") and hasattr(signal, x) for x in v),
        "a list of signal names such as [SIGTERM, SIGUSR1] ([] = do not catch any)",
    ),
    "reliability.preemption_check_every_n_steps": (lambda v: v >= 1, ">= 1"),
    "launcher": (lambda v: v in ("local", "slurm"), "local or slurm"),
    "slurm.nodes": (lambda v: v >= 1, ">= 1"),
    "slurm.gpus_per_node": (lambda v: v >= 0, ">= 0"),
    "slurm.tasks_per_node": (lambda v: v >= 0, ">= 0 (0: gpus_per_node)"),
    "slurm.cpus_per_task": (lambda v: v >= 1, ">= 1"),
    "slurm.mem_gb": (lambda v: v >= 0, ">= 0"),
    "slurm.time_min": (lambda v: v >= 1, ">= 1"),
    "slurm.signal_delay_s": (lambda v: v >= 0, ">= 0"),
    "slurm.max_requeues": (lambda v: v >= 0, ">= 0"),
}


def _rule_holds(ok: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(ok(value))
    except (TypeError, ValueError):  # e.g. a list of strings where numbers belong
        return False


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


#: Sources that read ``data.<split>.path`` as a folder, and what to give there.
_PATH_SOURCES = {
    "folder": "the folder source needs the folder holding the images",
    "fashion_mnist": "give the folder of the Fashion-MNIST idx files, or leave it unset (null) for the system copy",
}


def _check_folder_paths(cfg: DictConfig, errors: list[str]) -> None:
    """Sources that read a folder (``folder``, ``fashion_mnist``): a ``data.<split>.path`` that is set must be an
    existing folder (so a typo stops here, before the output folder is made, and never falls back to another
    copy), and for the ``folder`` source one that holds an image file; the ``folder`` source needs the train path.
    The ``filelist`` source likewise, with a file; the ``hf`` source, with a folder or file that exists."""
    for split in ("train", "test"):
        source = cfg.data[split].source or cfg.data.train.source
        path = cfg.data[split].path
        if source == "filelist":
            if path is None and split == "train":
                errors.append("'data.train.path' must be set for the filelist source: the file listing the images "
                              "(lines 'path' or 'path,label'), e.g. data.train.path=/data/train.csv")
            elif path is not None and not Path(str(path)).expanduser().is_file():
                what = ("is a folder, not a file (data=folder reads a folder of images)"
                        if Path(str(path)).expanduser().exists() else "does not exist")
                errors.append(f"'data.{split}.path' = {path}: {what}; the filelist source needs the file listing "
                              "the images, one 'path' or 'path,label' a line")
            continue
        if source == "webdataset":
            _check_shard_paths(split, path, errors)
            continue
        if source == "hf":
            if path is None and split == "train":
                errors.append("'data.train.path' must be set for the hf source: a folder written by datasets' "
                              "save_to_disk, or Parquet / Arrow files, e.g. data.train.path=/data/my_dataset")
            elif path is not None and not Path(str(path)).expanduser().exists():
                errors.append(f"'data.{split}.path' = {path}: does not exist; the hf source reads a folder written "
                              "by datasets' save_to_disk, or Parquet / Arrow files")
            continue
        if source not in _PATH_SOURCES:
            continue
        if path is None:
            if source == "folder" and split == "train":
                errors.append("'data.train.path' must be set for the folder source: the folder of images "
                              "(an ImageFolder tree or a flat folder), e.g. data.train.path=/data/train")
            continue
        folder = Path(str(path)).expanduser()
        if not folder.is_dir():
            what = "is a file, not a folder" if folder.exists() else "does not exist"
            errors.append(f"'data.{split}.path' = {path}: {what}; {_PATH_SOURCES[source]}")
        elif source == "folder":
            from sslkit.data.sources import IMAGE_EXTENSIONS, holds_images

            if holds_images(folder) is False:
                errors.append(f"'data.{split}.path' = {path}: no image files in the folder or below it (extensions "
                              f"{', '.join(IMAGE_EXTENSIONS)}, any case); {_PATH_SOURCES[source]}")


def _check_sources(cfg: DictConfig, errors: list[str]) -> None:
    """The sources' paths (:func:`_check_folder_paths`) and ``data.order=shards`` on a source with shards."""
    _check_folder_paths(cfg, errors)
    if cfg.data.order == "shards" and (cfg.data.train.source != "webdataset" or cfg.data.limit):
        errors.append(f"'data.order' = shards reads a sharded source shard by shard, and data.train.source="
                      f"{cfg.data.train.source}{' with data.limit' if cfg.data.limit else ''} has no shards to follow: "
                      "use data.order=random (or data=webdataset)")


def _check_shard_paths(split: str, path: Any, errors: list[str]) -> None:
    """``data=webdataset``: a train path, and shards that are all there (the first missing ones named)."""
    if path is None:
        if split == "train":
            errors.append("'data.train.path' must be set for the webdataset source: a folder of .tar shards, a brace "
                          "pattern (/data/train-{000000..000099}.tar) or a list file")
        return
    from sslkit.data.shards import expand_shards
    from sslkit.data.sources import DataSourceError

    try:
        shards = expand_shards(str(path))
    except DataSourceError as exc:
        errors.append(f"'data.{split}.path' = {path}: {exc}")
        return
    missing = [str(s) for s in shards if not s.is_file()]
    if not shards:
        errors.append(f"'data.{split}.path' = {path}: names no .tar shard (an empty folder or list)")
    elif missing:
        errors.append(f"'data.{split}.path' = {path}: {len(missing)} of its {len(shards)} shard(s) do not exist "
                      f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): check the pattern, or leave "
                      "them out")


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


def _check_method_rules(cfg: DictConfig, errors: list[str], steps: int | None) -> None:
    """The method's own rules (:attr:`sslkit.methods.base.Method.rules`, such as DINOv2's Sinkhorn-Knopp batch), on
    the run's shape as plain values (``steps``: the run's, when known)."""
    from sslkit.methods.base import RunShape

    method = R.METHODS.get(cfg.method.name) if cfg.method.name in R.METHODS else None
    if method is None or not method.rules or not isinstance(cfg.loss, DictConfig):
        return
    world = _world_size(cfg)
    kwargs = cfg.model.kwargs if isinstance(cfg.model.kwargs, DictConfig) else OmegaConf.create({})
    hooks = {name: _plain(h) for name, h in cfg.method.hooks.items() if isinstance(h, DictConfig)}
    shape = RunShape(per_process_batch(cfg, world), world, _plain(cfg.loss), _plain(kwargs), hooks, steps)
    for rule in method.rules:
        errors.extend(rule(shape))


def _plain(section: DictConfig) -> dict[str, Any]:
    plain = OmegaConf.to_container(section, resolve=True)
    return plain if isinstance(plain, dict) else {}


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def _why_no_cuda() -> str:
    """Why ``torch.cuda.is_available()`` is False, in words a user can act on."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch to use a GPU."
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no usable GPU{where}: "
            "check that a GPU and its driver are there (nvidia-smi).")


def _check_device(cfg: DictConfig, errors: list[str]) -> None:
    """``machine.device`` must name a device this machine has, and a run on GPUs needs one GPU per process
    (NCCL refuses two ranks on one GPU): checked here, before anything is written."""
    from sslkit.distributed import launched_by_torchrun

    device, d = str(cfg.machine.device), cfg.distributed
    torchrun = launched_by_torchrun()
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])) if torchrun else d.nproc_per_node
    how = "torchrun --nproc_per_node" if torchrun else "distributed.nproc_per_node"
    if device == "cpu" or (device == "auto" and not _cuda_available()):
        if d.backend == "nccl":
            why = "" if device == "cpu" else ", and no GPU is visible"
            errors.append(f"'distributed.backend' = nccl needs GPUs, but the processes run on the CPU (machine.device="
                          f"{device}{why}). Use distributed.backend=gloo or auto.")
        return
    if not _cuda_available():
        errors.append(f"'machine.device' = {device}: {_why_no_cuda()} Or set machine.device=cpu (auto picks the GPU "
                      "when there is one).")
        return
    count = _cuda_device_count()
    if device.startswith("cuda:"):
        index = device.split(":", 1)[1]
        if not index.isdigit() or int(index) >= count:
            errors.append(f"'machine.device' = {device}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}.")
        elif procs > 1:
            errors.append(f"'machine.device' = {device} names one GPU, but {procs} processes each need their own "
                          f"({how}={procs}): set machine.device=cuda, and process i uses cuda:i.")
    if procs > count:
        errors.append(f"'{how}' = {procs}: {procs} processes on GPUs need {procs} GPUs, and {count} is visible "
                      f"(one process per GPU; NCCL refuses two ranks on one GPU). Set {how}={count}, or "
                      f"machine.device=cpu to run {procs} CPU processes with gloo.")


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


def validate(cfg: DictConfig) -> None:
    """Check keys, types, values and registry names of a composed config; raise ConfigError."""
    errors: list[str] = []
    ref = schema()
    _check_tree(cfg, ref, "", errors)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    for key, (ok, req) in _VALUE_RULES.items():
        value = OmegaConf.select(cfg, key)
        if value is not None and not _rule_holds(ok, value):
            shown = list(value) if isinstance(value, ListConfig) else value
            errors.append(f"'{key}' must be {req}, got {shown!r}")
    d = cfg.distributed
    if not errors:
        _check_device(cfg, errors)
    from sslkit.distributed import launched_by_torchrun

    if d.num_nodes > 1 and not launched_by_torchrun():
        try:
            socket.getaddrinfo(str(d.master_addr), None)
        except (OSError, UnicodeError):
            errors.append(f"'distributed.master_addr' = {d.master_addr}: no such host (it does not resolve here), so "
                          "the processes could never meet. Set it to the address of node 0.")
    if not 0 <= d.node_rank < d.num_nodes:
        errors.append(f"'distributed.node_rank' must be in [0, num_nodes={d.num_nodes}), got {d.node_rank}")
    if cfg.optim.epochs == 0 and cfg.optim.max_steps == 0:
        errors.append("'optim.epochs' and 'optim.max_steps' are both 0: set one of them > 0")
    if cfg.data.decode_on == "device" and cfg.data.augment_on == "workers":
        errors.append("'data.decode_on' = device needs the augmentation on the device too (data.augment_on="
                      "workers): set data.augment_on=device or auto, or data.decode_on=auto")
    global_batch = _global_batch_errors(cfg)
    errors.extend(global_batch)
    steps = None
    if cfg.data.batch_size > 0 and cfg.optim.micro_batches >= 1 and not global_batch:
        steps = _check_steps(cfg, errors)
    _check_sources(cfg, errors)

    import sslkit.data
    import sslkit.hooks
    import sslkit.methods
    import sslkit.models
    import sslkit.train_steps.standard  # noqa: F401

    if cfg.data.batch_size > 0 and cfg.optim.micro_batches >= 1 and not global_batch:
        _check_method_rules(cfg, errors, steps)

    _registered(errors, R.TRAIN_STEPS, cfg.train_step, "train_step")
    for where, reg, section, skip in (
        ("data.transform", R.TRANSFORMS, cfg.data.transform, ("name",)),
        ("data.eval_transform", R.TRANSFORMS, cfg.data.eval_transform, ("name",)),
        ("model.head", R.HEADS, cfg.model.head, ("name",)),
        ("loss", R.LOSSES, cfg.loss, ("name",)),
    ):
        if not isinstance(section, DictConfig):
            errors.append(f"'{where}' must be a section (dict; {{}} for none), got {section!r}")
            continue
        if "name" not in section:
            errors.append(f"'{where}' needs a 'name'")
            continue
        builder = _registered(errors, reg, section.name, where + ".name")
        if builder is None:
            continue
        before = len(errors)
        _check_kwargs(where, builder, {k: v for k, v in section.items() if k not in skip}, errors)
        if reg is R.TRANSFORMS and len(errors) == before:
            _check_transform(cfg, where, builder, errors)
        if reg is R.LOSSES:
            _check_loss_call(section.name, builder, errors)
    model = _registered(errors, R.MODELS, cfg.model.name, "model.name")
    if model is not None:
        _check_kwargs("model.kwargs", model, dict(cfg.model.kwargs), errors)
    trunk = _registered(errors, R.TRUNKS, cfg.model.trunk, "model.trunk")
    if trunk is not None:
        _check_kwargs("model.trunk_kwargs", trunk, dict(cfg.model.trunk_kwargs), errors)
        _check_trunk(cfg, trunk, errors)
        _check_pretrained(cfg, trunk, errors)
        _check_strategy(cfg, trunk, errors)
    _check_masking(cfg, trunk, errors)
    for split in ("train", "test"):
        source = cfg.data[split].source or cfg.data.train.source
        builder = _registered(errors, R.DATASETS, source, f"data.{split}.source")
        if builder is not None:
            _check_kwargs(f"data.{split}.kwargs", builder, dict(cfg.data[split].kwargs), errors)
    _check_sections(cfg, ref, trunk, steps, errors)
    if not errors:
        _check_freeze(cfg, errors)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(dict.fromkeys(errors)))  # shared keys: once


def _check_sections(cfg: DictConfig, ref: DictConfig, trunk: Any, steps: int | None, errors: list[str]) -> None:
    """The hooks, the Gram and high-resolution settings, and the recipe's required keys."""
    _check_hooks(cfg, errors)
    _check_gram(cfg, ref.gram, errors)
    _check_distill(cfg, ref.distill, errors)
    _check_reference(cfg, errors)
    _check_teacher_crops(cfg, trunk, steps, errors)
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
        if entry.get("source") is not None:
            _registered(errors, R.DATASETS, entry["source"], f"eval.reference.sets[{i}].source")
        if entry.get("split", "test") not in ("train", "test"):
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


def _check_gram(cfg: DictConfig, defaults: DictConfig, errors: list[str]) -> None:
    """``gram.*`` changed from ``defaults`` (the schema's) for a run whose loss has no Gram term (only a dinov3
    recipe reads those keys)."""
    changed = [k for k, v in cfg.gram.items() if v != defaults.get(k)]
    if not changed or "gram_weight" in _loss_arguments(cfg):
        return
    errors.append(f"'gram.{changed[0]}' is set, but method.name={cfg.method.name} has no Gram anchoring: the gram.* "
                  "keys are read by method.name=dinov3 (config=dinov3, dinov3_adapt, dinov3_vits16, ...); drop them "
                  "or train a dinov3 recipe")


def _check_distill(cfg: DictConfig, defaults: DictConfig, errors: list[str]) -> None:
    """``distill.*``: read only by method.name=distill; there, a teacher that exists, a known teacher trunk,
    objective and metric, students that parse (a trunk each, no name twice, registered trunks)."""
    from sslkit.methods.distill import METRICS, OBJECTIVES, DistillError, student_specs

    d = cfg.distill
    if cfg.method.name != "distill":
        changed = [k for k, v in d.items() if v != defaults.get(k)]
        if changed:
            errors.append(f"'distill.{changed[0]}' is set, but method.name={cfg.method.name} does not distill: the "
                          "distill.* keys are read by method.name=distill (config=distill); drop them")
        return
    if d.teacher is not None and not os.path.exists(os.path.expanduser(str(d.teacher))):
        errors.append(f"'distill.teacher' = {d.teacher}: no such file or folder; give an sslkit run folder, a "
                      "checkpoint, or a .pth / .safetensors weights file (with distill.teacher_trunk)")
    trunk = d.teacher_trunk
    if trunk is not None and not str(trunk).startswith("timm:"):
        _registered(errors, R.TRUNKS, trunk, "distill.teacher_trunk")
    if d.objective not in OBJECTIVES:
        errors.append(f"'distill.objective' = {d.objective}: use one of {', '.join(OBJECTIVES)}")
    if d.metric not in METRICS:
        errors.append(f"'distill.metric' = {d.metric}: use one of {', '.join(METRICS)}")
    if d.objective == "dino" and d.teacher_blocks != 1:
        errors.append(f"'distill.teacher_blocks' = {d.teacher_blocks}: the dino objective reads the teacher's heads on "
                      "its final tokens; the last blocks concatenated are the feature objective's (LightlyTrain "
                      "distillationv2): set distill.teacher_blocks=1 or distill.objective=feature")
    try:
        specs = student_specs(OmegaConf.to_container(d.students, resolve=True))
    except DistillError as exc:
        errors.append(str(exc))
        return
    for spec in specs:
        _registered(errors, R.TRUNKS, spec["trunk"], f"distill.students ({spec['name']})")
    routed = {"teacher": "distill.teacher", "students": "distill.students", "objective": "distill.objective",
              "dense": "distill.patch_weight", "head_kwargs": "model.head", "lr_scales": "distill.students",
              "mask_student": "distill.mask_student", "teacher_blocks": "distill.teacher_blocks"}
    for key in sorted(set(cfg.model.kwargs) & set(routed)):
        errors.append(f"'model.kwargs.{key}' is the builder's to set for a distillation (from {routed[key]}): drop it "
                      f"and set {routed[key]}")
    if cfg.model.trunk != specs[0]["trunk"]:
        errors.append(f"'model.trunk' = {cfg.model.trunk}, but a distillation's model.trunk is its first student's "
                      f"({specs[0]['trunk']}): leave model.trunk unset (null), it is filled from distill.students")


def _check_teacher_crops(cfg: DictConfig, trunk: Any, steps: int | None, errors: list[str]) -> None:
    """``gram.teacher_size`` reaches the transform and a Gram teacher that is a second network; ``hires.*`` is a
    phase a ViT can run (:func:`~sslkit.data.resolution.phase_errors`), in the loader workers."""
    from sslkit.data.resolution import phase_errors

    h = cfg.hires
    teacher_sizes = [t for t in h.teacher_sizes if t is not None] if h.start_step is not None else []
    if cfg.gram.teacher_size is not None or teacher_sizes:
        key = "gram.teacher_size" if cfg.gram.teacher_size is not None else "hires.teacher_sizes"
        if "gram_weight" not in _loss_arguments(cfg):
            errors.append(f"'{key}' sizes the crops of a Gram teacher, and method.name={cfg.method.name} has none: "
                          f"drop {key} (or train a dinov3 recipe)")
        elif cfg.gram.teacher == "ema":
            errors.append(f"'{key}' gives the Gram teacher crops of its own, and gram.teacher=ema has no Gram teacher "
                          "network (the EMA teacher sees the student's crops): set gram.teacher=snapshot or file, or "
                          f"drop {key}")
        if cfg.data.transform.get("teacher_size", None) != cfg.gram.teacher_size:
            errors.append(f"'{key}' is set, but data.transform.teacher_size does not follow gram.teacher_size (the "
                          "multicrop transform makes the teacher's crops): set data.transform.teacher_size="
                          "${gram.teacher_size}, as the dinov3 recipes do")
    if h.start_step is None or trunk is None:
        return
    errors.extend(phase_errors(h.start_step, list(h.global_sizes), list(h.local_sizes), list(h.teacher_sizes),
                               list(h.ratios), _patch_size(cfg, trunk), steps))
    if cfg.data.augment_on == "device":
        errors.append("'hires.start_step' is set with data.augment_on=device: the crops of a high-resolution phase "
                      "are made in the loader workers (the device augmentation has one size per view): set "
                      "data.augment_on=workers or auto")


def _loss_arguments(cfg: DictConfig) -> list[str]:
    """The keyword arguments of the run's registered loss (none when it is not registered)."""
    name = cfg.loss.get("name") if isinstance(cfg.loss, DictConfig) else None
    if name is None or name not in R.LOSSES:
        return []
    return list(_parameters(R.LOSSES.get(name)))


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
    """``model.pretrained``: a file that exists, of a kind the loader reads, for a ViT trunk (whether its network
    is the trunk's is checked when it is read, before the first step)."""
    path = cfg.model.pretrained
    if path is None:
        return
    file = Path(str(path)).expanduser()
    if not getattr(trunk, "patch_tokens", False):
        errors.append(f"'model.pretrained' loads ViT backbones (sslkit's ViTs, timm's DINOv3 ViTs), and "
                      f"model.trunk={cfg.model.trunk} is none: use a ViT trunk or drop model.pretrained")
    elif not file.is_file():
        what = "is a folder, not a file" if file.exists() else "does not exist"
        errors.append(f"'model.pretrained' = {path}: {what}; give the .pth or .safetensors file of the backbone")
    elif file.suffix not in (".pth", ".pt", ".safetensors", ".bin"):
        errors.append(f"'model.pretrained' = {path}: not a .pth, .pt, .bin or .safetensors file of weights")


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
                      "set masking.name=none, or use a masked method (mae, ...)")
    if trunk is not None and not patches:
        errors.append(f"'masking.name' = {name} hides patches, and {cnn}")
    builder = _registered(errors, R.MASKINGS, name, "masking.name")
    if builder is None:
        return
    kwargs = {k: v for k, v in section.items() if k not in ("name", "views")}
    before = len(errors)
    _check_kwargs("masking", builder, kwargs, errors)
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


def _check_freeze(cfg: DictConfig, errors: list[str]) -> None:
    """Every ``model.freeze`` entry is well formed. (That its glob names a parameter of the model is checked where
    the model is built: :func:`sslkit.builder.freeze_parameters`; validation never builds a model.)"""
    try:
        freeze_entries(cfg.model.freeze)
    except ConfigError as exc:
        errors.append(str(exc))


def _check_hooks(cfg: DictConfig, errors: list[str]) -> None:
    """The method exists; its hooks (``method.hooks``) and the added ones (``hooks``) are registered with valid
    arguments; no hook the method requires is dropped; an added hook does not repeat one of the method's."""
    method = _registered(errors, R.METHODS, cfg.method.name, "method.name")
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
        hook = _registered(errors, R.HOOKS, name, where)
        if hook is not None:
            _check_kwargs(where, hook, dict(kwargs), errors)
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
        hook = _registered(errors, R.HOOKS, spec.name, where + ".name")
        if hook is not None:
            _check_kwargs(where, hook, {k: v for k, v in spec.items() if k != "name"}, errors)
