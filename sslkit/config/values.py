"""A config's keys, types and values: the schema's tree, a builder's arguments against its signature, registered
names, and the table of value rules. The first layer of validation (:mod:`sslkit.config.validate`)."""

from __future__ import annotations

import inspect
import math
import signal
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from sslkit import registry as R
from sslkit.config.schema import FREE_FORM, GROUPS, flat_keys, schema
from sslkit.errors import did_you_mean as _nearest

__all__ = ["VALUE_RULES", "check_kwargs", "check_tree", "check_values", "registered"]


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


def check_tree(cfg: DictConfig, ref: DictConfig, prefix: str, errors: list[str]) -> None:
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
                check_tree(value, expected, path + ".", errors)
            continue
        exp_v, got_v = ref[key], cfg[key]
        if exp_v is None or got_v is None or exp_v == "auto":
            continue  # a key that defaults to auto takes values of several types: its value rule alone checks it
        if not _compatible(exp_v, got_v):
            errors.append(f"'{path}' must be {_type_name(exp_v)} (like {exp_v!r}), got {_type_name(got_v)} {got_v!r}")


def _parameters(builder: Callable[..., Any]) -> Any:
    """The parameters of a registered builder: a class's ``__init__``'s, a function's own."""
    return inspect.signature(builder.__init__ if inspect.isclass(builder) else builder).parameters


def check_kwargs(where: str, builder: Callable[..., Any], kwargs: dict[str, Any], errors: list[str],
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


def registered(errors: list[str], reg: Any, name: Any, where: str) -> Any:
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


#: The value table: key -> (what must hold of its value, the requirement in words). A key that defaults to auto takes
#: values of several types, and this rule alone checks it (a method checks those of its own sections in its rules).
VALUE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
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
    "data.read_attempts": (lambda v: v >= 1, ">= 1"),
    "data.cache_gb": (lambda v: v >= 0 and _finite(v), ">= 0 (0: no local copies of whole shards)"),
    "data.read_backoff_s": (lambda v: v >= 0 and _finite(v), ">= 0 (seconds)"),
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
    "eval.bench.robustness.table": (lambda v: v in ("auto", "imagenet", "cifar"), "auto, imagenet or cifar"),
    "eval.bench.level": (lambda v: isinstance(v, float) and 0.5 <= v < 1.0, "a number in [0.5, 1)"),
    "eval.bench.linear.val_fraction": (lambda v: isinstance(v, float) and 0.0 < v < 1.0, "a number in (0, 1)"),
    "eval.bench.attentive.val_fraction": (lambda v: isinstance(v, float) and 0.0 < v < 1.0, "a number in (0, 1)"),
    "eval.bench.attentive.epochs": (lambda v: v >= 1, ">= 1"),
    "eval.dense.window": (lambda v: v is None or v == "auto" or (isinstance(v, int) and not isinstance(v, bool)
                                                                  and v >= 1), "auto, null or a number of pixels"),
    "eval.dense.dataset": (lambda v: v in ("scenes", "fashion_mnist", "folder", "wild"),
                           "scenes, fashion_mnist, wild or folder"),
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



def check_values(cfg: DictConfig, errors: list[str]) -> None:
    """Every key of the value table (:data:`VALUE_RULES`) holds its rule."""
    for key, (ok, req) in VALUE_RULES.items():
        value = OmegaConf.select(cfg, key)
        if value is not None and not _rule_holds(ok, value):
            shown = list(value) if isinstance(value, ListConfig) else value
            errors.append(f"'{key}' must be {req}, got {shown!r}")
