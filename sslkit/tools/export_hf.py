"""``sslkit export format=hf``: a ViT trunk as a Hugging Face transformers DINOv2 / DINOv3 checkpoint folder that
``transformers.AutoModel.from_pretrained`` loads whole, checked against sslkit's own features before it is kept."""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
from typing import Any

import torch
from torch import nn

from sslkit.models.hf_weights import hf_to_meta
from sslkit.tools.pretrained import ToolError

__all__ = ["export_hf", "hf_config_of", "timm_to_meta"]

#: transformers' output must equal sslkit's trunk (CLS, registers, patch tokens) to this, on the CPU in float32.
HF_ATOL = 1e-5


def _is_dinov3(trunk: nn.Module) -> bool:
    from sslkit.models.rope_vit_trunk import RopeViTTrunk

    return isinstance(trunk, RopeViTTrunk)


def _gated(trunk: nn.Module) -> bool:
    return hasattr(trunk.blocks[0].mlp, "fc1_g")


def timm_to_meta(trunk: nn.Module) -> dict[str, torch.Tensor]:
    """The trunk's weights (sslkit's ViT: timm's ``VisionTransformer``; the DINOv3 trunk: timm's ``Eva``) in the
    layout of Meta's releases: registers as ``register_tokens`` / ``storage_tokens``, LayerScale as ``ls1/ls2.gamma``,
    DINOv2's position table with its CLS row (zero: sslkit's CLS token holds its position), DINOv3's q / v biases
    joined into ``qkv.bias`` around a zero key bias, its SwiGLU as ``w1 / w2 / w3``."""
    dinov3 = _is_dinov3(trunk)
    state = {k: v.detach().float().cpu() for k, v in trunk.state_dict().items()}  # read only: no copy
    out: dict[str, torch.Tensor] = {}
    biases: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key == "reg_token":
            out["storage_tokens" if dinov3 else "register_tokens"] = value
        elif key == "pos_embed":  # sslkit's ViT: no_embed_class, the CLS token's position folded into it
            out[key] = torch.cat([value.new_zeros(1, 1, value.shape[-1]), value], dim=1)
        elif re.fullmatch(r"blocks\.\d+\.attn\.[qv]_bias", key):
            biases.setdefault(key.rsplit(".", 1)[0], {})[key[-6]] = value
        else:
            key = re.sub(r"\.gamma_([12])$", r".ls\1.gamma", key)
            if dinov3 and _gated(trunk):  # timm's SwiGLU -> Meta's w1 (gate), w2 (up), w3 (down)
                for timm_name, meta_name in (("fc1_g", "w1"), ("fc1_x", "w2"), ("fc2", "w3")):
                    key = key.replace(f"mlp.{timm_name}.", f"mlp.{meta_name}.")
            out[key] = value
    for attn, qv in biases.items():
        out[f"{attn}.qkv.bias"] = torch.cat([qv["q"], torch.zeros_like(qv["q"]), qv["v"]])
    return out


def hf_config_of(trunk: nn.Module) -> Any:
    """The transformers config of the trunk's network: ``Dinov2Config`` / ``Dinov2WithRegistersConfig`` for sslkit's
    ViT (LayerScale 1 where it has none: the identity), ``DINOv3ViTConfig`` for the DINOv3 trunk."""
    import transformers

    block = trunk.blocks[0]
    shape = {"hidden_size": int(trunk.out_dim), "num_hidden_layers": len(trunk.blocks),
             "num_attention_heads": int(block.attn.num_heads), "patch_size": int(trunk.patch_size),
             "num_channels": int(trunk.in_channels), "image_size": int(trunk.patch_embed.img_size[0]),
             "layerscale_value": 1.0}
    if _is_dinov3(trunk):
        gated = _gated(trunk)
        hidden = (block.mlp.fc1_g if gated else block.mlp.fc1).out_features
        biased = getattr(block.attn, "q_bias", None) is not None
        return transformers.DINOv3ViTConfig(
            **shape, intermediate_size=int(hidden), num_register_tokens=int(trunk.num_registers),
            use_gated_mlp=gated, hidden_act="silu" if gated else "gelu", query_bias=biased, value_bias=biased,
            key_bias=False, layer_norm_eps=float(trunk.norm.eps), rope_theta=float(trunk.rope.temperature))
    ratio = block.mlp.fc1.out_features / trunk.out_dim
    if ratio != int(ratio):  # transformers' DINOv2 takes a whole MLP ratio
        raise ToolError(f"format=hf: the trunk's MLP is {ratio:g} times its width; transformers' DINOv2 takes a "
                        "whole ratio")
    extra = {"mlp_ratio": int(ratio), "qkv_bias": block.attn.qkv.bias is not None,
             "layer_norm_eps": float(trunk.norm.eps)}
    if trunk.num_registers:
        return transformers.Dinov2WithRegistersConfig(**shape, **extra, num_register_tokens=int(trunk.num_registers))
    return transformers.Dinov2Config(**shape, **extra)


def _hf_state(meta: dict[str, torch.Tensor], model: nn.Module, dinov3: bool) -> dict[str, torch.Tensor]:
    """Every tensor of the transformers ``model``, taken from Meta's layout: each of the model's names is read back
    through :func:`~sslkit.models.hf_weights.hf_to_meta` (the one mapping, read in reverse), q / k / v and the gated
    MLP's pieces cut from their joined tensors, LayerScale 1 where the trunk has none."""
    width = int(model.config.hidden_size)
    out = {}
    for name, own in model.state_dict().items():
        if own.numel() == 0:  # DINOv3's register tokens when it has none
            out[name] = own
            continue
        piece = {name: own}
        placed = hf_to_meta(piece, model.config.to_dict())
        if placed.state:
            (meta_key, _), = placed.state.items()
            found = meta.get(meta_key)
            out[name] = found.reshape(own.shape) if found is not None else _default(meta_key, own)
            continue
        joined = re.search(r"\.(q|k|v)_proj\.|\.(query|key|value)\.", name)
        if joined:  # one third of the block's qkv
            index = int(re.search(r"layer\.(\d+)\.", name).group(1))  # type: ignore[union-attr]
            which = "qkv".index((joined.group(1) or joined.group(2))[0])
            full = meta[f"blocks.{index}.attn.qkv.{name.rsplit('.', 1)[1]}"]
            out[name] = full[which * width:(which + 1) * width]
            continue
        out[name] = _mlp_piece(meta, name, dinov3)
    return out


def _default(meta_key: str, own: torch.Tensor) -> torch.Tensor:
    """What the trunk has no tensor for: LayerScale (none: 1, the identity), the mask token (none: zeros)."""
    if meta_key.endswith("gamma"):
        return torch.ones_like(own)
    if meta_key == "mask_token":
        return torch.zeros_like(own)
    raise ToolError(f"format=hf: the trunk has no {meta_key} for transformers' model")


def _mlp_piece(meta: dict[str, torch.Tensor], name: str, dinov3: bool) -> torch.Tensor:
    """A gated MLP's gate / up / down tensor or a plain one's up / down, from Meta's names."""
    found = re.search(r"layer\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.(weight|bias)$", name)
    if found is None:
        raise ToolError(f"format=hf: transformers' {name} has no counterpart in the trunk")
    at, part, kind = f"blocks.{found.group(1)}.mlp.", found.group(2), found.group(3)
    if f"{at}fc1.{kind}" in meta:  # a plain MLP (DINOv3's up / down)
        return meta[f"{at}{'fc1' if part == 'up_proj' else 'fc2'}.{kind}"]
    if dinov3:
        return meta[f"{at}{ {'gate_proj': 'w1', 'up_proj': 'w2', 'down_proj': 'w3'}[part]}.{kind}"]
    if part == "down_proj":
        return meta[f"{at}w3.{kind}"]
    gate, up = meta[f"{at}w12.{kind}"].chunk(2)
    return gate if part == "gate_proj" else up


def export_hf(trunk: nn.Module, folder: str) -> dict[str, Any]:
    """Write ``trunk`` (a ViT) to ``folder`` as a transformers checkpoint (``save_pretrained``: config.json and
    model.safetensors), after checking that ``transformers.AutoModel.from_pretrained`` loads it with no missing or
    unexpected key and gives the trunk's CLS, register and patch tokens to :data:`HF_ATOL` on a random batch (float32,
    CPU, eval mode). Returns what the sidecar records: the model type, the check, how to load it."""
    try:
        import transformers
    except ImportError:
        raise ToolError("format=hf needs Hugging Face transformers, which is not installed: pip install "
                        "'transformers>=4.56'") from None
    from sslkit.models.tokens import TokenTrunk

    if not isinstance(trunk, TokenTrunk) or not hasattr(trunk, "timm_spec"):
        raise ToolError(f"format=hf writes sslkit's ViTs (as DINOv2) and DINOv3 trunks (as DINOv3); the trunk is "
                        f"{type(trunk).__name__}: use format=safetensors or onnx")
    ours = copy.deepcopy(trunk).to("cpu", torch.float32).eval()  # as export's twin checks copy it
    config = hf_config_of(ours)
    model = transformers.AutoModel.from_config(config).eval()
    model.load_state_dict(_hf_state(timm_to_meta(ours), model, _is_dinov3(ours)), strict=True)
    work = tempfile.mkdtemp(prefix=".hf-", dir=os.path.dirname(os.path.abspath(folder)) or ".")
    try:
        model.save_pretrained(work)
        loaded, info = transformers.AutoModel.from_pretrained(work, output_loading_info=True)
        problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if problems:
            raise ToolError(f"format=hf: transformers read the folder back with {problems}")
        difference = _token_difference(ours, loaded.eval())
        if difference > HF_ATOL:
            raise ToolError(f"format=hf: transformers' tokens differ from sslkit's by {difference:.3g} (allowed "
                            f"{HF_ATOL:g}): not written")
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        os.replace(work, folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"model_type": config.model_type, "class": type(loaded).__name__,
            "checked": {"max_abs_difference": difference, "tokens": "CLS, registers, patches"},
            "load": f"transformers.AutoModel.from_pretrained('{os.path.basename(folder)}')"}


def _token_difference(trunk: nn.Module, model: nn.Module) -> float:
    """The largest difference between the trunk's tokens (CLS, registers, patches after the final norm) and
    transformers' ``last_hidden_state`` on a random batch at the trunk's size."""
    side = int(model.config.image_size)
    x = torch.randn(2, int(model.config.num_channels), side, side, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens = trunk.forward_tokens(x)
        ours = torch.cat([tokens.cls[:, None], tokens.registers, tokens.patches], dim=1)
        theirs = model(pixel_values=x).last_hidden_state
    if ours.shape != theirs.shape:
        raise ToolError(f"format=hf: transformers gives {tuple(theirs.shape)} tokens, sslkit {tuple(ours.shape)}")
    return float((ours - theirs).abs().max())
