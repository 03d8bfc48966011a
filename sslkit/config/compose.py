"""Compose a run's config with Hydra (``config=NAME data=NAME a.b=c``) and validate it before anything runs."""

from __future__ import annotations

import copy
import importlib
import inspect
import math
import os
import re
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf

from sslkit import registry as R
from sslkit.config.run_keys import folder_suffix
from sslkit.errors import UserError
from sslkit.errors import did_you_mean as _nearest

__all__ = [
    "ABSENT",
    "CONFIG_DIRS",
    "ConfigError",
    "compose_config",
    "flatten_config",
    "format_recipe_diff",
    "freeze_entries",
    "group_choices",
    "import_modules",
    "per_process_batch",
    "recipe_diff",
    "schema",
    "show_value",
    "validate",
]

PACKAGE_CONFIG_DIR = Path(__file__).resolve().parent
#: Folders searched for the ``config`` and ``data`` groups, the repository's ``configs/`` first.
CONFIG_DIRS: list[Path] = [PACKAGE_CONFIG_DIR.parents[1] / "configs"]

#: Keys whose contents are builder arguments, checked against the builder's signature.
FREE_FORM = {
    "hooks", "method.hooks", "data.train.kwargs", "data.test.kwargs", "data.transform", "data.eval_transform",
    "model.trunk_kwargs", "model.head", "model.kwargs", "loss", "eval.data.train.kwargs", "eval.data.test.kwargs",
    "masking", "model.freeze", "slurm.additional", "log.mlflow.tags",
}
GROUPS = ("config", "data")
#: Keys that take values of several types; their value rule alone checks them.
_VALUE_RULES_ONLY = {"log.progress_bar", "checkpoint.sharded", "data.num_workers", "data.pin_memory",
                     "eval.monitors.enabled", "eval.knn.subsample"}


class ConfigError(UserError, ValueError):
    """A config that cannot run: what is wrong, with the key, and what to do."""


_DEFAULTS_FILE: dict[tuple[int, int], DictConfig] = {}


def _defaults_file() -> DictConfig:
    """sslkit/config/defaults.yaml as loaded (parsed once a process while the file is unchanged; a copy)."""
    st = (PACKAGE_CONFIG_DIR / "defaults.yaml").stat()
    key = (st.st_mtime_ns, st.st_size)
    if key not in _DEFAULTS_FILE:
        _DEFAULTS_FILE.clear()
        _DEFAULTS_FILE[key] = OmegaConf.load(PACKAGE_CONFIG_DIR / "defaults.yaml")  # type: ignore[assignment]
    return copy.deepcopy(_DEFAULTS_FILE[key])


def schema() -> DictConfig:
    """sslkit/config/defaults.yaml without its defaults list: every valid key and its type."""
    cfg = _defaults_file()
    cfg.pop("defaults")
    return cfg  # type: ignore[return-value]


def _group_options(group: str) -> list[str]:
    return sorted({p.stem for d in CONFIG_DIRS for p in (d / group).glob("*.yaml")})


def _flat_keys(cfg: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(cfg, DictConfig):
        for k in cfg.keys():
            path = f"{prefix}{k}"
            yield path
            if path not in FREE_FORM:
                yield from _flat_keys(cfg._get_node(k), path + ".")


#: Hydra compositions of this process by their group choices and the state of the config files (at most
#: :data:`_COMPOSED_MAX`): a run composes its recipe twice (its config, then the recipe it changed), and a process
#: that runs several (tests, doctor, audit) composes the same recipes again; Hydra's YAML parsing is most of it.
_COMPOSED: dict[tuple[Any, ...], DictConfig] = {}
_COMPOSED_MAX = 32


def _config_files_stamp() -> tuple[tuple[str, int, int], ...]:
    """Every config file's path, modification time and size: a composition made before a file changed is not
    used after."""
    stamp = []
    for root in (PACKAGE_CONFIG_DIR, *CONFIG_DIRS):
        for path in sorted(root.rglob("*.yaml")):
            st = path.stat()
            stamp.append((str(path), st.st_mtime_ns, st.st_size))
    return tuple(stamp)


def _hydra_compose(overrides: list[str]) -> DictConfig:
    """The defaults, recipe and data preset chosen by the group ``overrides`` (``config=``, ``data=``), composed
    by Hydra; a copy, so the caller may change it."""
    key = (tuple(overrides), tuple(str(d) for d in CONFIG_DIRS), _config_files_stamp())
    if key not in _COMPOSED:
        search = ",".join(f"file://{d}" for d in CONFIG_DIRS)
        with initialize_config_dir(config_dir=str(PACKAGE_CONFIG_DIR), version_base=None):
            composed = compose("defaults", overrides=[*overrides, f"hydra.searchpath=[{search}]"])
        while len(_COMPOSED) >= _COMPOSED_MAX:
            _COMPOSED.pop(next(iter(_COMPOSED)))
        _COMPOSED[key] = composed
    return copy.deepcopy(_COMPOSED[key])


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose defaults + recipe + data preset + ``overrides``, import ``imports``, validate.

    Raises :class:`ConfigError` naming the closest valid key, group option or registered name
    for anything unknown, and the key for wrong types or impossible values. Nothing is built
    or written here.
    """
    for ov in overrides:
        if "=" not in ov and not ov.startswith("~"):
            raise ConfigError(f"override '{ov}' is not of the form key=value (e.g. optim.lr=0.1), +key=value "
                              "(add a key) or ~key (delete one)")
        key, value = ov.split("=", 1) if "=" in ov else (ov, "")
        if key in GROUPS and value not in _group_options(key):
            options = _group_options(key)
            raise ConfigError(
                f"{key}={value}: no configs/{key}/{value}.yaml.{_nearest(value, options)} "
                f"Available: {', '.join(options)}."
            )
    groups = [ov for ov in overrides if ov.split("=", 1)[0] in GROUPS]
    rest = [ov for ov in overrides if ov not in groups]  # the key=value overrides
    try:
        cfg = _hydra_compose(groups)
    except HydraException as exc:
        raise ConfigError(str(exc).split("\nConfig search path:")[0]) from None
    OmegaConf.set_struct(cfg, False)
    apply_overrides(cfg, rest)
    choices = {g: "" for g in GROUPS}
    for ov in overrides:
        key, value = ov.split("=", 1) if "=" in ov else (ov, "")
        if key in GROUPS:
            choices[key] = value
    named = bool(cfg.name)
    if not named:
        cfg.name = f"{choices['config'] or 'simclr'}-{choices['data'] or 'fashion_mnist'}"
    if not cfg.output_dir:  # a name given is the folder's; the default name carries what else the command changes
        suffix = "" if named else folder_suffix(rest)
        cfg.output_dir = os.path.join("runs", f"{cfg.name}{suffix}")
    sized = _sized_for_error(cfg, rest, choices["data"] or "fashion_mnist")
    if sized:
        raise ConfigError(f"invalid config:\n  {sized}")
    import_modules(cfg)
    resolve_method(cfg)
    validate(cfg)
    OmegaConf.set_struct(cfg, True)
    return cfg


#: The paper-scale recipes of a method, named where a recipe sized for small images meets large ones.
PAPER_SCALE = {"dinov2": "dinov2_vits16, dinov2_vitb16", "ibot": "ibot_vits16, ibot_vitb16",
               "ijepa": "ijepa_vits16, ijepa_vitb16"}


def _sized_for_error(cfg: DictConfig, overrides: list[str], data: str) -> str | None:
    """A recipe whose patches and crops were chosen for ``sized_for`` px images, on images at least twice as large
    (four times the tokens) without the command setting its patches (``model.trunk_kwargs...``) or ``sized_for``:
    what it would train, and what to run instead."""
    sized_for = cfg.get("sized_for")
    keys = {ov.split("=", 1)[0].lstrip("+~") for ov in overrides}
    if not sized_for or int(cfg.data.image_size) < 2 * int(sized_for) or "sized_for" in keys or \
            any(k == "model.trunk_kwargs" or k.startswith("model.trunk_kwargs.") for k in keys):
        return None
    size, patch = int(cfg.data.image_size), cfg.model.trunk_kwargs.get("patch_size", cfg.data.patch_size)
    files = [d / "data" / f"{data}.yaml" for d in CONFIG_DIRS if (d / "data" / f"{data}.yaml").exists()]
    preset = OmegaConf.load(files[0]).get("data", {}) if files else {}
    small = cfg.data.get("small_image_size")
    crops = f" and {small} px local crops" if small and cfg.data.transform.get("num_small") else ""
    method = str(cfg.method.name)
    paper = PAPER_SCALE.get(method, ", ".join(v.split(", ")[0] for v in PAPER_SCALE.values()))
    to_set = [f"model.trunk_kwargs.patch_size={preset.get('patch_size', 16)}"]
    if crops and preset.get("small_image_size"):
        to_set.append(f"data.small_image_size={preset.get('small_image_size')}")
    return (f"'sized_for' = {sized_for}: this recipe's patches and crops were chosen for {sized_for} px images "
            f"(Fashion-MNIST), and data.image_size is {size}: its {patch} px patches{crops} would give "
            f"{(size // patch) ** 2} tokens a global crop. For real images run a paper-scale recipe "
            f"(config={paper.split(', ')[0]} data={data} ...; all: {paper}), or set the sizes for these images: "
            f"{' '.join(to_set)} (the data={data} preset's), or sized_for=null to train this recipe's sizes as "
            f"they are.")


def resolve_method(cfg: DictConfig) -> None:
    """Fill what the method decides and the config left open (null): ``model.name``, ``loss.name`` and
    ``data.transform.name`` become the method's model wiring, loss and default augmentation, so the saved
    config says what ran. An unknown method is left for :func:`validate` to report."""
    import sslkit.methods  # noqa: F401  (registrations)

    name = cfg.get("method", {}).get("name") if isinstance(cfg.get("method"), DictConfig) else None
    if not isinstance(name, str) or name not in dict(R.METHODS):
        return
    method = R.METHODS.get(name)
    masking = cfg.get("masking")
    for section, value in ((cfg.model, method.model), (cfg.loss, method.loss), (cfg.data.transform, method.transform),
                           (masking, method.masking or "none")):
        if isinstance(section, DictConfig) and section.get("name") is None:
            section.name = value


def import_modules(cfg: DictConfig) -> None:
    """Import the modules of ``imports`` (user registrations), from the working directory too.

    ``imports=my_ssl.hooks`` (one name, no brackets) is taken as ``[my_ssl.hooks]``. The working
    directory is put on ``sys.path`` (as ``python -m`` would), so a module next to where the
    command runs imports without setting PYTHONPATH.
    """
    if isinstance(cfg.imports, str):
        cfg.imports = [cfg.imports] if cfg.imports else []
    if not isinstance(cfg.imports, ListConfig):
        raise ConfigError(f"'imports' must be a list of module names like [my_ssl.hooks], got {cfg.imports!r}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    for module in cfg.imports:
        if not isinstance(module, str) or not module:
            raise ConfigError(f"imports: {module!r} is not a module name (like my_ssl.hooks)")
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"imports: cannot import '{module}' ({exc}). The working directory ({cwd}) and "
                              "PYTHONPATH are searched: run from the folder that holds it, or add that folder "
                              "to PYTHONPATH.") from None


def _in_free_form(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") or key.startswith(f + "[") for f in FREE_FORM)


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> None:
    """Apply ``key=value``, ``+key=value`` and ``~key`` overrides (Hydra's grammar) to ``cfg``.

    A key that does not exist is an error naming the closest key, unless it is added with ``+``
    (then validation decides) or lies in a free-form section (builder arguments).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:
        raise ConfigError(f"cannot parse overrides: {exc}") from None
    for ov in parsed:
        key = ov.key_or_group
        if ov.is_sweep_override():
            raise ConfigError(f"'{ov.input_line}': sweeps are not supported; run once per value")
        exists = OmegaConf.select(cfg, key, default=_MISSING) is not _MISSING
        if ov.is_delete():
            if not exists:
                raise ConfigError(f"cannot delete '{key}': no such key")
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            node.pop(leaf)
            continue
        if not exists and not ov.is_add() and not _in_free_form(key):
            known = [*GROUPS, *_flat_keys(cfg)] if "." not in key else list(_flat_keys(cfg))
            raise ConfigError(f"unknown config key '{key}'.{_nearest(key, known)} "
                              "Every key is listed in sslkit/config/defaults.yaml.")
        OmegaConf.update(cfg, key, ov.value(), merge=False, force_add=True)


_MISSING = object()


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
            known = [f"{prefix}{k}" for k in ref.keys()] + list(_flat_keys(schema()))
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


def _check_kwargs(where: str, builder: Callable[..., Any], kwargs: dict[str, Any], errors: list[str],
                  provided: tuple[str, ...] = ()) -> None:
    """Every key of ``kwargs`` must be an argument of ``builder``; required ones must be there."""
    target = builder.__init__ if inspect.isclass(builder) else builder
    params = inspect.signature(target).parameters
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
    "data.decode_on": (lambda v: v in ("auto", "workers", "device"), "auto, workers or device"),
    "data.limit": (lambda v: v >= 0, ">= 0 (0 = all)"),
    "data.image_size": (lambda v: v > 0, "> 0 (the crop side in pixels)"),
    "data.small_image_size": (lambda v: v > 0, "> 0 (the local crop side in pixels)"),
    "data.min_crop_scale": (lambda v: 0 < v <= 1, "in (0, 1] (an area fraction)"),
    "data.blur_p": (_probability, "a probability in [0, 1]"),
    "data.patch_size": (lambda v: v > 0, "> 0 (a ViT patch's side in pixels)"),
    "optim.layer_decay": (lambda v: 0 < v <= 1, "in (0, 1] (1 = off)"),
    "optim.patch_embed_lr_mult": (lambda v: v > 0 and _finite(v), "> 0 (1 = off)"),
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
    "optim.accumulate_steps": (lambda v: v >= 1, ">= 1"),
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
                errors.append(f"'{where}.{key}' has {len(values)} values but the images of the {split} split "
                              f"(source {name}) have {shape.channels} channel(s): give one value, or one per channel.")
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
    The ``filelist`` source likewise, with a file."""
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


def per_process_batch(cfg: DictConfig, world: int) -> int:
    """The images one process takes per micro-batch: ``data.global_batch_size / (world x optim.accumulate_steps)``
    when a global batch is set (it must divide; :func:`compose_config` says so), else ``data.batch_size``."""
    g = cfg.data.global_batch_size
    return g // (world * cfg.optim.accumulate_steps) if g > 0 else cfg.data.batch_size


def _global_batch_errors(cfg: DictConfig) -> list[str]:
    """``data.global_batch_size`` must split evenly over the processes and micro-batches."""
    g, world, acc = cfg.data.global_batch_size, _world_size(cfg), cfg.optim.accumulate_steps
    per = world * acc
    if g <= 0 or acc < 1 or g % per == 0:
        return []
    lower, higher = g // per * per, -(-g // per) * per
    options = " or ".join(str(v) for v in dict.fromkeys((lower, higher)) if v > 0)
    return [f"'data.global_batch_size' = {g} does not split over {world} process(es) x optim.accumulate_steps={acc} "
            f"= {per} micro-batches: set it to a multiple of {per} ({options}), or change the number of processes "
            "or optim.accumulate_steps"]


def _world_size(cfg: DictConfig) -> int:
    """The processes of the run: torchrun's ``WORLD_SIZE``, else ``nproc_per_node`` x ``num_nodes``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return cfg.distributed.nproc_per_node * cfg.distributed.num_nodes


def _check_steps(cfg: DictConfig, errors: list[str]) -> None:
    """With a known number of training samples (``data.limit`` or a synthetic source), at least one
    optimizer step per epoch must fit."""
    from sslkit.data.sources import source_shape

    try:
        kwargs = OmegaConf.to_container(cfg.data.train.kwargs, resolve=True)
        n = source_shape(str(cfg.data.train.source), kwargs).num_samples  # type: ignore[arg-type]
    except (TypeError, ValueError):
        n = None
    limit = cfg.data.limit
    if limit > 0:
        n = limit if n is None else min(n, limit)
    if not n:
        return
    acc, world = cfg.optim.accumulate_steps, _world_size(cfg)
    b = per_process_batch(cfg, world)
    drop = cfg.data.drop_last
    per_rank = n // world if drop else -(-n // world)
    batches = per_rank // b if drop else -(-per_rank // b)
    if batches // acc == 0:
        where = "data.limit" if limit > 0 and limit == n else "data.train.kwargs.num_samples"
        key = "data.global_batch_size" if cfg.data.global_batch_size > 0 else "data.batch_size"
        errors.append(f"'{key}' = {cfg.data[key.split('.')[1]]}: a step takes {b} x {world} process(es) x "
                      f"optim.accumulate_steps={acc} = {b * world * acc} samples, more than the {n} training samples "
                      f"({where}={n}): no optimizer step would run. Lower {key} or raise {where}.")


def _check_sinkhorn(cfg: DictConfig, errors: list[str]) -> None:
    """``loss.centering=sinkhorn_knopp`` (DINOv2) gives every prototype ``1 / K`` of each solve's mass and every teacher
    row ``1 / R`` (``R`` rows: all global crops of all processes), so a row spreads over at least ``K / R``
    prototypes: its target's entropy is at least ``ln(K / R)``. DINOv2 runs 65536 prototypes on 2048 rows (32 per
    row, at least 3.5 of ln K's 11.1 nats). Below ``R = sqrt(K)`` the floor passes half of ``ln K``: the teacher can
    no longer say much about any image, a config error."""
    loss = cfg.loss
    if not isinstance(loss, DictConfig) or loss.get("centering") != "sinkhorn_knopp":
        return
    world = _world_size(cfg)
    b = per_process_batch(cfg, world)
    kwargs = cfg.model.kwargs if isinstance(cfg.model.kwargs, DictConfig) else {}
    crops = int(kwargs.get("num_global", 2) or 2)
    k = OmegaConf.select(cfg, "loss.out_dim")
    rows = b * world * crops
    if isinstance(k, int) and isinstance(rows, int) and rows * rows < k:
        errors.append(f"'loss.centering' = sinkhorn_knopp: each Sinkhorn-Knopp solve sees data.batch_size={b} x "
                      f"{world} process(es) x {crops} global crops = {rows} teacher rows for loss.out_dim={k} "
                      f"prototypes, so every row must spread over at least {k / rows:.0f} prototypes and the "
                      f"teacher's targets are nearly uniform (entropy >= ln({k / rows:.0f}), more than half of "
                      f"ln({k})). Raise data.batch_size (to at least {-(-(math.isqrt(k - 1) + 1) // (world * crops))} "
                      f"here, or run more processes), lower "
                      f"model.head.out_dim and loss.out_dim (at most {rows * rows}), or use loss.centering=centering.")


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
    _check_tree(cfg, schema(), "", errors)
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
    if cfg.data.batch_size > 0 and cfg.optim.accumulate_steps >= 1 and not global_batch:
        _check_steps(cfg, errors)
        _check_sinkhorn(cfg, errors)
    _check_folder_paths(cfg, errors)

    import sslkit.data
    import sslkit.hooks
    import sslkit.methods
    import sslkit.models
    import sslkit.train_steps.standard  # noqa: F401

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
    model = _registered(errors, R.MODELS, cfg.model.name, "model.name")
    if model is not None:
        _check_kwargs("model.kwargs", model, dict(cfg.model.kwargs), errors)
    trunk = _registered(errors, R.TRUNKS, cfg.model.trunk, "model.trunk")
    if trunk is not None:
        _check_kwargs("model.trunk_kwargs", trunk, dict(cfg.model.trunk_kwargs), errors)
        _check_trunk(cfg, trunk, errors)
        _check_strategy(cfg, trunk, errors)
    _check_masking(cfg, trunk, errors)
    for split in ("train", "test"):
        source = cfg.data[split].source or cfg.data.train.source
        builder = _registered(errors, R.DATASETS, source, f"data.{split}.source")
        if builder is not None:
            _check_kwargs(f"data.{split}.kwargs", builder, dict(cfg.data[split].kwargs), errors)
    _check_hooks(cfg, errors)
    if not errors:
        _check_freeze(cfg, errors)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(dict.fromkeys(errors)))  # shared keys: once


def _crop_sizes(cfg: DictConfig) -> list[tuple[str, int]]:
    """Every crop size the run feeds its trunk, with the key to set to change it: the training transform's
    sizes (``image_size``, a multi-crop's ``small_size`` when it has small crops) and the evaluation's."""
    sizes: list[tuple[str, int]] = []
    for where in ("data.transform", "data.eval_transform"):
        section = OmegaConf.select(cfg, where)
        if not isinstance(section, DictConfig):
            continue
        for key in ("image_size", "small_size"):
            if key == "small_size" and section.get("num_small", 1) == 0:
                continue
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                sizes.append((_origin(section, key, f"{where}.{key}"), value))
    return list(dict.fromkeys(sizes))


def _check_trunk(cfg: DictConfig, trunk: Any, errors: list[str]) -> None:
    """A trunk's own checks (a ViT's kwargs against timm's), and for a patch trunk that every crop is a whole
    number of patches."""
    check = getattr(trunk, "check_kwargs", None)
    if callable(check):
        errors.extend(check(dict(cfg.model.trunk_kwargs)))
    if getattr(trunk, "patch_tokens", False):
        from sslkit.models.vit import patch_grid_errors

        patch = cfg.model.trunk_kwargs.get("patch_size", cfg.data.patch_size)
        if isinstance(patch, int) and patch > 0:
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
    if method is not None and method.masking is None:
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
    """``model.freeze`` as ``(glob, unit, n)``: unit None (the whole run), ``updates`` or ``epochs``. Raises
    :class:`ConfigError` for an entry that is neither a glob nor ``{params: GLOB, updates|epochs: N}``."""
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
            raise ConfigError(f"'{where}' must be a glob (like trunk.patch_embed.*) or {{params: GLOB, updates: N}} / "
                              f"{{params: GLOB, epochs: N}}, got {item!r}")
        extra = set(item.keys()) - {"params", "updates", "epochs"}
        units = [u for u in ("updates", "epochs") if u in item]
        if extra or len(units) > 1:
            raise ConfigError(f"'{where}' takes params and one of updates / epochs, got {sorted(item.keys())}")
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


class _Absent:
    """The value :func:`recipe_diff` gives a key that one side does not have."""

    def __repr__(self) -> str:
        return "(not set)"


#: A key that the recipe or the run does not have, in :func:`recipe_diff`'s tuples.
ABSENT: Any = _Absent()
#: Keys that every run sets for itself: not a change from the recipe.
_OWN_KEYS = ("name", "output_dir")


def group_choices(overrides: list[str]) -> dict[str, str]:
    """The recipe and data preset a run uses: ``config=``/``data=`` of ``overrides``, else the defaults."""
    choices: dict[str, str] = {}
    for item in _defaults_file().defaults:
        if isinstance(item, DictConfig):
            choices.update({str(k): str(v) for k, v in item.items()})
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if sep and key in GROUPS:
            choices[key] = value
    return choices


def flatten_config(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": 1, "c": [1, 2]}`` (lists are values; empty dicts vanish)."""
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(flatten_config(value, f"{prefix}{key}."))
    return flat


def recipe_diff(overrides: list[str], cfg: DictConfig) -> list[tuple[str, Any, Any]]:
    """What a run changed from its recipe and data preset: ``(key, recipe value, run value)`` for every
    dotted key (lists compared whole) whose resolved value differs between the config composed from
    the ``config=``/``data=`` overrides alone and ``cfg``; a key only one side has gets :data:`ABSENT`
    on the other. ``name`` and ``output_dir`` are not changes. Nothing is imported or validated."""
    groups = [ov for ov in overrides if ov.partition("=")[0] in GROUPS]
    composed = _hydra_compose(groups)
    OmegaConf.set_struct(composed, False)
    resolve_method(composed)  # the names the method fills in are the recipe's, not the run's changes
    recipe = flatten_config(OmegaConf.to_container(composed, resolve=True))
    run = flatten_config(OmegaConf.to_container(cfg, resolve=True))
    diffs = []
    for key in dict.fromkeys([*run, *recipe]):
        if key in _OWN_KEYS:
            continue
        before, after = recipe.get(key, ABSENT), run.get(key, ABSENT)
        if not _same(before, after):
            diffs.append((key, before, after))
    return diffs


def _same(a: Any, b: Any) -> bool:
    """Equal values (1 and 1.0 are; true and 1 are not; a key that is absent equals nothing)."""
    if a is ABSENT or b is ABSENT:
        return False
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def show_value(value: Any) -> str:
    """A value as it would be typed on the command line (yaml flow style: true, null, [0.9, 0.99])."""
    if value is ABSENT:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(show_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value) if value != "" else "''"


def format_recipe_diff(overrides: list[str], cfg: DictConfig) -> str:
    """A short account of a run's config for its log: recipe, data preset, and each key changed from them
    (one per line, ``key recipe_value -> value``), or ``as the recipe``; the full config is in
    ``<output_dir>/config.yaml``."""
    choices = group_choices(overrides)
    head = f"config: recipe {choices.get('config', '?')}, data {choices.get('data', '?')}"
    where = os.path.join(str(cfg.output_dir), "config.yaml")
    diffs = recipe_diff(overrides, cfg)
    if not diffs:
        return f"{head}, as the recipe (the full config is in {where})"
    lines = [f"  {key} {show_value(before)} -> {show_value(after)}" for key, before, after in diffs]
    return "\n".join([f"{head}; changed from them:", *lines, f"(the full config is in {where})"])
