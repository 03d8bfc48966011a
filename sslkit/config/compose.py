"""Compose a run's config with Hydra (``config=NAME data=NAME a.b=c``), then validate it (sslkit/config/validate.py)
before anything runs."""

from __future__ import annotations

import importlib
import os
import pickle
import sys
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf

from sslkit import registry as R
from sslkit.config.run_keys import folder_suffix
from sslkit.config.schema import (
    GROUPS,
    MISSING,
    PACKAGE_CONFIG_DIR,
    ConfigError,
    config_dirs,
    flat_keys,
    group_options,
    in_free_form,
)
from sslkit.config.validate import validate
from sslkit.errors import did_you_mean as _nearest

__all__ = ["PAPER_SCALE", "apply_overrides", "compose_config", "hydra_compose", "import_modules", "resolve_method"]

#: Hydra compositions of this process by their group choices and the state of the config files (at most
#: :data:`_COMPOSED_MAX`): a run composes its recipe twice (its config, then the recipe it changed), and a process
#: that runs several (tests, doctor, audit) composes the same recipes again; Hydra's YAML parsing is most of it.
_COMPOSED: dict[tuple[Any, ...], bytes] = {}


_COMPOSED_MAX = 32


def _config_files_stamp() -> tuple[tuple[str, int, int], ...]:
    """Every config file's path, modification time and size: a composition made before a file changed is not
    used after."""
    stamp = []
    for root in (PACKAGE_CONFIG_DIR, *config_dirs()):
        for path in sorted(root.rglob("*.yaml")):
            st = path.stat()
            stamp.append((str(path), st.st_mtime_ns, st.st_size))
    return tuple(stamp)


def hydra_compose(overrides: list[str]) -> DictConfig:
    """The defaults, recipe and data preset chosen by the group ``overrides`` (``config=``, ``data=``), composed
    by Hydra; a copy, so the caller may change it (kept pickled: unpickling copies a config in a seventh of
    ``copy.deepcopy``'s time)."""
    choices = tuple(sorted(dict(ov.split("=", 1) for ov in overrides).items()))  # (the last of a group wins)
    key = (choices, tuple(str(d) for d in config_dirs()), _config_files_stamp())
    if key not in _COMPOSED:
        search = ",".join(f"file://{d}" for d in config_dirs())
        with initialize_config_dir(config_dir=str(PACKAGE_CONFIG_DIR), version_base=None):
            composed = compose("defaults", overrides=[*overrides, f"hydra.searchpath=[{search}]"])
        while len(_COMPOSED) >= _COMPOSED_MAX:
            _COMPOSED.pop(next(iter(_COMPOSED)))
        _COMPOSED[key] = pickle.dumps(composed)
    return pickle.loads(_COMPOSED[key])


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
        if key in GROUPS and value not in group_options(key):
            options = group_options(key)
            raise ConfigError(
                f"{key}={value}: no configs/{key}/{value}.yaml.{_nearest(value, options)} "
                f"Available: {', '.join(options)}."
            )
    groups = [ov for ov in overrides if ov.split("=", 1)[0] in GROUPS]
    rest = [ov for ov in overrides if ov not in groups]  # the key=value overrides
    try:
        cfg = hydra_compose(groups)
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
    keys = {ov.split("=", 1)[0].lstrip("+~") for ov in rest}  # the keys the command sets
    sized = _sized_for_error(cfg, keys, choices["data"] or "fashion_mnist")
    if sized:
        raise ConfigError(f"invalid config:\n  {sized}")
    _scale_patches(cfg, keys)
    _drop_preset_trunk_kwargs(cfg, keys, choices["data"] or "fashion_mnist")
    import_modules(cfg)
    resolve_method(cfg)
    apply_stats(cfg)
    validate(cfg)
    OmegaConf.set_struct(cfg, True)
    return cfg


#: The paper-scale recipes of a method, named where a recipe sized for small images meets large ones.
PAPER_SCALE = {"dinov2": "dinov2_vits16, dinov2_vitb16", "ibot": "ibot_vits16, ibot_vitb16",
               "ijepa": "ijepa_vits16, ijepa_vitb16", "dinov3": "dinov3_vits16, dinov3_vitb16, dinov3_vitl16"}


def _sized_for_error(cfg: DictConfig, keys: set[str], data: str) -> str | None:
    """A recipe whose patches and crops were chosen for ``sized_for`` px images, on images at least twice as large
    (four times the tokens) without the command setting its patches (``model.trunk_kwargs...``) or ``sized_for``:
    what it would train, and what to run instead."""
    sized_for = cfg.get("sized_for")
    if not sized_for or int(cfg.data.image_size) < 2 * int(sized_for) or "sized_for" in keys or \
            any(k == "model.trunk_kwargs" or k.startswith("model.trunk_kwargs.") for k in keys):
        return None
    size, patch = int(cfg.data.image_size), cfg.model.trunk_kwargs.get("patch_size", cfg.data.patch_size)
    files = [d / "data" / f"{data}.yaml" for d in config_dirs() if (d / "data" / f"{data}.yaml").exists()]
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


def _scale_patches(cfg: DictConfig, keys: set[str]) -> None:
    """A recipe sized for ``sized_for`` px images (the Fashion-MNIST ViT recipes: 28) on images of another size
    below twice it (CIFAR's and the wild set's 32 px) that its patches do not divide: its patch size, and its local
    crop size (``data.small_image_size``) where the new patches do not divide it, multiplied by ``data.image_size
    / sized_for`` where that comes out whole and the patches divide the crops (28 -> 32 px: patches 7 -> 8, local
    crops 14 -> 16, the same token grids). Not when the command sets ``model.trunk_kwargs``,
    ``data.small_image_size`` or ``sized_for`` (then the patch check names what to set). The run's log lists what
    changed among what changed from the recipe."""
    sized_for, size = cfg.get("sized_for"), int(cfg.data.image_size)
    patch = cfg.model.get("trunk_kwargs", {}).get("patch_size")
    if not sized_for or not patch or size == int(sized_for) or size >= 2 * int(sized_for) or size % int(patch) == 0 \
            or keys & {"sized_for", "data.small_image_size", "model.trunk_kwargs.patch_size", "model.trunk_kwargs"}:
        return
    new_patch = int(patch) * size / int(sized_for)
    if new_patch != int(new_patch) or size % int(new_patch):
        return
    small = cfg.data.get("small_image_size")
    if small and int(small) % int(new_patch):  # local crops the new patches do not divide: scaled alike
        new_small = int(small) * size / int(sized_for)
        if new_small != int(new_small) or int(new_small) % int(new_patch):
            return
        cfg.data.small_image_size = int(new_small)
    cfg.model.trunk_kwargs.patch_size = int(new_patch)


def _drop_preset_trunk_kwargs(cfg: DictConfig, keys: set[str], data: str) -> None:
    """A data preset's trunk comes with its arguments (data=cifar10: resnet18 with ``small_image_stem``); a recipe
    that names another trunk (a ViT) replaces both, so the preset's arguments the command does not set are taken
    out of ``model.trunk_kwargs`` (they were merged into the recipe's and stopped every ViT recipe on CIFAR)."""
    found = [d / "data" / f"{data}.yaml" for d in config_dirs() if (d / "data" / f"{data}.yaml").is_file()]
    preset = OmegaConf.load(found[0]).get("model") if found else None
    if not preset or not preset.get("trunk") or preset.trunk == cfg.model.trunk or "model.trunk_kwargs" in keys:
        return
    for key, value in (preset.get("trunk_kwargs") or {}).items():
        if f"model.trunk_kwargs.{key}" not in keys and cfg.model.trunk_kwargs.get(key) == value:
            del cfg.model.trunk_kwargs[key]


def apply_stats(cfg: DictConfig) -> None:
    """``data.stats=FILE`` (what ``sslkit data stats`` wrote): its per-channel mean and std become the training and
    evaluation transforms' normalisation where they give none of their own, and its channel count the splits' that
    would count theirs from the images (``auto``). A file that is missing or holds no mean and std is a
    :class:`ConfigError` naming it; one of another channel count than the data's is named by validation."""
    path = cfg.data.get("stats")
    if not path:
        return
    import json

    try:
        with open(os.path.expanduser(str(path)), encoding="utf-8") as f:
            found = json.load(f)
        mean, std = [float(v) for v in found["mean"]], [float(v) for v in found["std"]]
    except FileNotFoundError:
        raise ConfigError(f"'data.stats' = {path}: no such file; write it with sslkit data stats path=DATA "
                          f"output={path}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"'data.stats' = {path}: not a statistics file of sslkit data stats ({type(exc).__name__}: "
                          f"{exc}); write it again with sslkit data stats path=DATA output={path}") from None
    for section in (cfg.data.transform, cfg.data.eval_transform):
        if section.get("mean") is None and section.get("std") is None:
            section.mean, section.std = mean, std
    _channels_from_stats(cfg, len(mean))


def _channels_from_stats(cfg: DictConfig, channels: int) -> None:
    """A split whose source would count its channels from its images (``channels: auto``) reads ``data.stats``'
    count instead: the file was computed on these images, and the config then says the count before any is read."""
    from sslkit.data.sources import counts_channels

    for split in ("train", "test"):
        spec = cfg.data[split]
        if OmegaConf.is_interpolation(spec, "kwargs"):  # the train split's kwargs, filled there
            continue
        source = spec.source or cfg.data.train.source
        if source in dict(R.DATASETS) and counts_channels(source, spec.kwargs or {}):
            if spec.kwargs is None:
                spec.kwargs = {}
            spec.kwargs.channels = channels


def resolve_method(cfg: DictConfig) -> None:
    """Fill what the method decides and the config left open (null): ``model.name``, ``loss.name`` and
    ``data.transform.name`` become the method's model wiring, loss and default augmentation, so the saved
    config says what ran; then the method completes the rest from its own sections
    (:attr:`~sslkit.methods.base.Method.complete`). An unknown method is left for :func:`validate` to report."""
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
    if method.complete is not None:
        method.complete(cfg)


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
        exists = OmegaConf.select(cfg, key, default=MISSING) is not MISSING
        if ov.is_delete():
            if not exists:
                raise ConfigError(f"cannot delete '{key}': no such key")
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            node.pop(leaf)
            continue
        if not exists and not ov.is_add() and not in_free_form(key):
            known = [*GROUPS, *flat_keys(cfg)] if "." not in key else list(flat_keys(cfg))
            raise ConfigError(f"unknown config key '{key}'.{_nearest(key, known)} "
                              "Every key is listed in sslkit/config/defaults.yaml.")
        OmegaConf.update(cfg, key, ov.value(), merge=False, force_add=True)
