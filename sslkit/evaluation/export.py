"""Export a trained trunk as a state_dict for its torchvision twin (safetensors or .pt), with its normalisation."""

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

__all__ = ["export_main", "export_trunk", "torchvision_twin"]

logger = logging.getLogger("sslkit")

#: sslkit trunks that are torchvision ResNets without their classifier.
_TWINS = {"resnet18": "resnet18", "resnet34": "resnet34", "resnet50": "resnet50", "resnet101": "resnet101"}

EXPORT_KEYS = {
    "checkpoint": "a run folder (its latest checkpoint) or a checkpoint file",
    "output": "the file: .safetensors (default <run>/export/encoder.safetensors) or .pt",
    "features": "trunk (default) | teacher (the momentum encoder of BYOL, MoCo, DINO)",
    "twin": "torchvision (default: must load strictly into torchvision.models.<trunk>) | none (sslkit's own "
            "trunk, e.g. small_cnn or the small-image stem; loads into sslkit's trunk builder)",
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
    model.eval()
    # compared on the CPU in float32: on CUDA, TF32 convolutions would differ by more than the tolerance
    ref = copy.deepcopy(trunk).to("cpu", torch.float32).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = ref(x).float()
        theirs = model(x).float()
    if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5):
        raise ToolError(f"the exported weights load into torchvision.models.{twin} but give other features (max "
                        f"difference {(ours - theirs).abs().max().item():.3g}): please report this as a bug")
    return state


def _save(path: str, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    if path.endswith(".safetensors"):
        from safetensors.torch import save

        data = save(state, metadata={"sslkit": json.dumps(meta)})
        atomic_write(path, lambda f: f.write(data))
    else:
        atomic_write(path, lambda f: torch.save(state, f))


def _export(args: list[str]) -> int:
    from sslkit.evaluation.tools import _encoder, _features_part, _pretrained, parse_tool_args

    opts, overrides = parse_tool_args("export", args, EXPORT_KEYS)
    output = opts.get("output")
    if output and not output.endswith((".safetensors", ".pt", ".pth")):
        raise ToolError(f"output={output}: the file's extension says the format: .safetensors or .pt")
    twin_mode = opts.get("twin", "torchvision")
    if twin_mode not in ("torchvision", "none"):
        raise ToolError(f"twin={twin_mode}: use twin=torchvision or twin=none")
    pre: Pretrained = _pretrained("export", opts, overrides)
    part = _features_part(opts, ("trunk", "teacher"))
    trunk = _encoder(pre, part)
    channels = next(p for p in trunk.parameters() if p.ndim == 4).shape[1]
    twin, why = torchvision_twin(pre.config, channels)
    if twin_mode == "torchvision" and twin is None:
        raise ToolError(f"this trunk has no torchvision twin: {why}. Export it with twin=none (a state_dict for "
                        "sslkit's own trunk builder, sslkit.models.trunks), or pretrain a torchvision trunk "
                        "(model.trunk=resnet50 without small_image_stem).")
    if twin_mode == "none":
        twin = None
    state = export_trunk(trunk, twin)
    path = output or os.path.join(pre.run_dir, "export", "encoder.safetensors")
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    norm = normalisation(pre.config, int(channels))
    feature_dim = int(getattr(trunk, "out_dim", 0)) or None
    meta = {
        "architecture": f"torchvision.models.{twin}" if twin else f"sslkit trunk {pre.config.model.trunk}",
        "classifier": "fc = torch.nn.Identity()" if twin else None,
        "trunk_kwargs": dict(pre.config.model.trunk_kwargs), "in_channels": int(channels),
        "feature_dim": feature_dim, "input": norm, "method": str(pre.config.method.name), "features": part,
        "checkpoint": pre.path, "step": pre.step,
        "load": (f"m = torchvision.models.{twin}(); m.fc = torch.nn.Identity(); "
                 f"m.load_state_dict(safetensors.torch.load_file('{os.path.basename(path)}'))") if twin else
                (f"m = sslkit.models.trunks.build_{pre.config.model.trunk}(in_channels={channels}, **trunk_kwargs); "
                 "m.load_state_dict(...)"),
    }
    _save(path, state, meta)
    sidecar = os.path.splitext(path)[0] + ".json"
    text = json.dumps(meta, indent=1)
    atomic_write(sidecar, lambda f: f.write(text.encode()))
    logger.info("export: %d tensors of the %s (step %d) -> %s (%s); input: pixels in [0, 1], mean %s, std %s; "
                "details in %s", len(state), part, pre.step, path, meta["architecture"], norm["mean"], norm["std"],
                sidecar)
    return 0


def export_main(argv: list[str] | None = None) -> int:
    """``sslkit export checkpoint=RUN_DIR output=encoder.safetensors [features=teacher] [twin=none]``"""
    from sslkit.evaluation.tools import run_tool

    keys = "\n".join(f"  {k}=...  {v}" for k, v in EXPORT_KEYS.items())
    usage = ("usage: sslkit export checkpoint=RUN_DIR|FILE [output=encoder.safetensors] [key=value ...]\n\n"
             "The trunk's weights as a plain state_dict that loads with strict=True into the matching torchvision "
             "model (fc = nn.Identity()), and its input normalisation in a .json next to it.\n\n" + keys)
    return run_tool("export", _export, argv, usage)
