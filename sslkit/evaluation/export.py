"""Export a trained trunk as a state_dict for its torchvision (ResNets) or timm (ViTs) twin, with its normalisation."""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any

import torch
from torch import nn

from sslkit.checkpoint import atomic_write
from sslkit.evaluation.pretrained import Pretrained, ToolError, normalisation

__all__ = ["export_main", "export_trunk", "export_vit", "timm_twin", "torchvision_twin"]

logger = logging.getLogger("sslkit")

#: sslkit trunks that are torchvision ResNets without their classifier.
_TWINS = {"resnet18": "resnet18", "resnet34": "resnet34", "resnet50": "resnet50", "resnet101": "resnet101"}

#: ``twin=``: what the exported weights must load into.
TWIN_MODES = ("auto", "torchvision", "timm", "none")

EXPORT_KEYS = {
    "checkpoint": "a run folder (its latest checkpoint) or a checkpoint file",
    "output": "the file: .safetensors (default <run>/export/encoder.safetensors) or .pt",
    "features": "trunk (default) | teacher (the momentum encoder of BYOL, MoCo, DINO)",
    "twin": "auto (default: torchvision for a ResNet, timm for a ViT) | torchvision (must load strictly into "
            "torchvision.models.<trunk>) | timm (a ViT: must load strictly into timm.create_model(arch, num_classes=0, "
            "**kwargs)) | none (sslkit's own trunk, e.g. small_cnn or the small-image stem; loads into sslkit's trunk "
            "builder)",
}


def torchvision_twin(cfg: Any, in_channels: int) -> tuple[str | None, str]:
    """The torchvision model a trunk equals (``resnet50``), or None with what differs."""
    name = str(cfg.model.trunk)
    if name not in _TWINS:
        return None, (f"model.trunk={name} is sslkit's own network, not a torchvision model")
    kwargs = dict(cfg.model.trunk_kwargs)
    if kwargs.get("small_image_stem"):
        return None, (f"{name} with model.trunk_kwargs.small_image_stem=true: its conv1 is 3x3 with stride 1 "
                      "(torchvision: 7x7 stride 2) and it has no max-pool (torchvision: 3x3 stride 2)")
    if in_channels != 3:
        return None, f"{name} on {in_channels}-channel images: its conv1 takes {in_channels} channels (torchvision: 3)"
    return _TWINS[name], ""


def _plain_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state_dict as contiguous, unshared CPU tensors (what safetensors stores), without the prefixes
    ``torch.compile`` (``_orig_mod.``) or DDP (``module.``) may add."""
    out: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict().items():
        key = key.replace("_orig_mod.", "")  # torch.compile's wrapper, at any depth
        if key.startswith("module."):  # a DDP wrapper, at the top only ("submodule." must stay)
            key = key[len("module."):]
        out[key] = value.detach().to("cpu").contiguous().clone()
    return out


def timm_twin(trunk: nn.Module) -> tuple[str, dict[str, Any]] | None:
    """The timm architecture and keyword arguments of a ViT trunk, such that ``timm.create_model(arch,
    num_classes=0, **kwargs)`` is the same network (``kwargs`` without ``num_classes``, JSON-serialisable);
    None for a trunk that is not timm's (no ``timm_spec``)."""
    spec = getattr(trunk, "timm_spec", None)
    if not callable(spec):
        return None
    arch, kwargs = spec()
    plain = json.loads(json.dumps({k: v for k, v in kwargs.items() if k != "num_classes"},
                                  default=lambda v: list(v) if isinstance(v, tuple) else str(v)))
    return str(arch), plain


def _same_features(ours: nn.Module, theirs: nn.Module, inputs: list[torch.Tensor], what: str) -> None:
    """``ours`` (a float32 CPU copy, in eval mode) and ``theirs`` give the same features on every input (rtol 1e-4,
    atol 1e-5), else a :class:`ToolError` naming ``what``: a bug."""
    ref = copy.deepcopy(ours).to("cpu", torch.float32).eval()
    theirs.eval()
    for x in inputs:
        with torch.no_grad():
            a, b = ref(x).float(), theirs(x).float()
        if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            diff = (f"max difference {(a - b).abs().max().item():.3g}" if a.shape == b.shape else
                    f"shapes {tuple(a.shape)} and {tuple(b.shape)}")
            raise ToolError(f"the exported weights load into {what} but give other features on a {tuple(x.shape)} "
                            f"input ({diff}): please report this as a bug")


def export_trunk(trunk: nn.Module, twin: str | None) -> dict[str, torch.Tensor]:
    """The trunk's weights; with a ``twin``, checked to load with ``strict=True`` into
    ``torchvision.models.<twin>(weights=None)`` whose ``fc`` is ``nn.Identity()`` and to give the same features
    (to 1e-5 on a random batch, both in eval mode, on the CPU)."""
    state = _plain_state(trunk)
    if twin is None:
        return state
    import torchvision

    model = getattr(torchvision.models, twin)(weights=None)
    model.fc = nn.Identity()
    model.load_state_dict(state, strict=True)
    # compared on the CPU in float32: on CUDA, TF32 convolutions would differ by more than the tolerance
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    _same_features(trunk, model, [x], f"torchvision.models.{twin}")
    return state


#: Parameters of sslkit's ViT that timm's VisionTransformer does not have, with why.
_NOT_IN_TIMM = {"mask_token": "the learned mask token of masked-image methods (iBOT, DINOv2, SimMIM): it replaces "
                              "masked patches during pretraining only, and timm's VisionTransformer has none"}


def export_vit(trunk: nn.Module) -> tuple[dict[str, torch.Tensor], str, dict[str, Any], dict[str, str]]:
    """A ViT trunk's weights for timm: ``(state, arch, kwargs, left_out)``, the state checked to load with
    ``strict=True`` into ``timm.create_model(arch, num_classes=0, **kwargs)`` and to give the same features at the
    trunk's image size and at one patch more (position embeddings resampled), on a float32 CPU copy in eval mode.
    ``left_out``: the parameters timm's model has no place for (the mask token), with why."""
    import timm

    found = timm_twin(trunk)
    if found is None:
        raise ToolError(f"{type(trunk).__name__} is not one of sslkit's ViTs (it has no timm_spec): export it with "
                        "twin=none")
    arch, kwargs = found
    state = _plain_state(trunk)
    left_out = {key: why for key, why in _NOT_IN_TIMM.items() if state.pop(key, None) is not None}
    model = timm.create_model(arch, num_classes=0, **kwargs)
    model.load_state_dict(state, strict=True)
    side, patch = int(kwargs["img_size"]), int(kwargs["patch_size"])
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, int(kwargs.get("in_chans", 3)), s, s, generator=g) for s in (side, side + patch)]
    _same_features(trunk, model, inputs, f"timm.create_model('{arch}', num_classes=0, **kwargs)")
    return state, arch, kwargs, left_out


def _save(path: str, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    if path.endswith(".safetensors"):
        from safetensors.torch import save

        data = save(state, metadata={"sslkit": json.dumps(meta)})
        atomic_write(path, lambda f: f.write(data))
    else:
        atomic_write(path, lambda f: torch.save(state, f))


def _twin(mode: str, trunk: nn.Module, cfg: Any, channels: int) -> tuple[str, str | None]:
    """What ``twin=mode`` exports for: ``("torchvision", name)``, ``("timm", None)`` or ``("none", None)``; a twin
    the trunk does not have is a :class:`ToolError` saying what to give instead."""
    vit = timm_twin(trunk) is not None
    if mode == "auto":
        mode = "timm" if vit else "torchvision"
    if mode == "none":
        return mode, None
    if mode == "timm":
        if not vit:
            raise ToolError(f"twin=timm: model.trunk={cfg.model.trunk} is not a ViT, and only sslkit's ViTs are timm's "
                            "networks. Export it with twin=torchvision (ResNets) or twin=none (sslkit's own trunk).")
        return mode, None
    if vit:
        raise ToolError(f"twin=torchvision: model.trunk={cfg.model.trunk} is a ViT, timm's VisionTransformer, with no "
                        "torchvision twin. Export it with twin=timm (the default, twin=auto, does) or twin=none.")
    name, why = torchvision_twin(cfg, channels)
    if name is None:
        raise ToolError(f"this trunk has no torchvision twin: {why}. Export it with twin=none (a state_dict for "
                        "sslkit's own trunk builder, sslkit.models.trunks), or pretrain a torchvision trunk "
                        "(model.trunk=resnet50 without small_image_stem).")
    return mode, name


def _builder_kwargs(cfg: Any, channels: int) -> dict[str, Any]:
    """The arguments sslkit's trunk builder was called with (``model.trunk_kwargs`` completed with the channels and,
    for a ViT, the data's image and patch size), JSON-plain."""
    from sslkit import registry as R
    from sslkit.builder import trunk_arguments

    builder = R.get(R.TRUNKS, cfg.model.trunk, "model.trunk")
    return json.loads(json.dumps(trunk_arguments(cfg, builder, channels), default=str))


def _export(args: list[str]) -> int:
    from sslkit.evaluation.tools import _features_part, _module, _pretrained, parse_tool_args

    opts, overrides = parse_tool_args("export", args, EXPORT_KEYS)
    output = opts.get("output")
    if output and not output.endswith((".safetensors", ".pt", ".pth")):
        raise ToolError(f"output={output}: the file's extension says the format: .safetensors or .pt")
    twin_mode = opts.get("twin", "auto")
    if twin_mode not in TWIN_MODES:
        raise ToolError(f"twin={twin_mode}: use twin={', twin='.join(TWIN_MODES)}")
    pre: Pretrained = _pretrained("export", opts, overrides)
    part = _features_part(opts, ("trunk", "teacher"))
    trunk = _module(pre, part)
    channels = next(p for p in trunk.parameters() if p.ndim == 4).shape[1]
    kind, twin = _twin(twin_mode, trunk, pre.config, int(channels))
    path = output or os.path.join(pre.run_dir, "export", "encoder.safetensors")
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    file = os.path.basename(path)
    loader = "safetensors.torch.load_file" if path.endswith(".safetensors") else "torch.load"
    norm = normalisation(pre.config, int(channels))
    meta: dict[str, Any]
    if kind == "timm":
        state, arch, kwargs, left_out = export_vit(trunk)
        meta = {
            "architecture": f"timm {arch}", "timm_arch": arch, "timm_kwargs": kwargs,
            "classifier": "none (num_classes=0): the model's output is the pooled features "
                          f"({'the CLS token' if kwargs.get('global_pool') == 'token' else 'the mean patch token'})",
            "left_out": left_out or None,
            "load": f"m = timm.create_model('{arch}', num_classes=0, **encoder_json['timm_kwargs']); "
                    f"m.load_state_dict({loader}('{file}'))"}
    else:
        state = export_trunk(trunk, twin)
        meta = {
            "architecture": f"torchvision.models.{twin}" if twin else f"sslkit trunk {pre.config.model.trunk}",
            "classifier": "fc = torch.nn.Identity()" if twin else None,
            "load": (f"m = torchvision.models.{twin}(); m.fc = torch.nn.Identity(); "
                     f"m.load_state_dict({loader}('{file}'))") if twin else
                    (f"import sslkit.models; m = sslkit.registry.TRUNKS.get('{pre.config.model.trunk}')"
                     f"(**encoder_json['builder_kwargs']); m.load_state_dict({loader}('{file}'))")}
    meta.update({"trunk_kwargs": dict(pre.config.model.trunk_kwargs),
                 "builder_kwargs": _builder_kwargs(pre.config, int(channels)), "in_channels": int(channels),
                 "feature_dim": int(getattr(trunk, "out_dim", 0)) or None, "input": norm,
                 "method": str(pre.config.method.name), "features": part, "checkpoint": pre.path, "step": pre.step})
    _save(path, state, meta)
    sidecar = os.path.splitext(path)[0] + ".json"
    text = json.dumps(meta, indent=1)
    atomic_write(sidecar, lambda f: f.write(text.encode()))
    logger.info("export: %d tensors of the %s (step %d) -> %s (%s); input: pixels in [0, 1], mean %s, std %s; "
                "details in %s", len(state), part, pre.step, path, meta["architecture"], norm["mean"], norm["std"],
                sidecar)
    return 0


def export_main(argv: list[str] | None = None) -> int:
    """``sslkit export checkpoint=RUN_DIR output=encoder.safetensors [features=teacher] [twin=auto|timm|none]``"""
    from sslkit.evaluation.tools import run_tool

    keys = "\n".join(f"  {k}=...  {v}" for k, v in EXPORT_KEYS.items())
    usage = ("usage: sslkit export checkpoint=RUN_DIR|FILE [output=encoder.safetensors] [key=value ...]\n\n"
             "The trunk's weights as a plain state_dict that loads with strict=True into the matching torchvision "
             "model (a ResNet, fc = nn.Identity()) or timm model (a ViT, num_classes=0), and its input normalisation "
             "and the model's arguments in a .json next to it.\n\n" + keys)
    return run_tool("export", _export, argv, usage)
