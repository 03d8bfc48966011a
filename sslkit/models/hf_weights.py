"""Hugging Face transformers' DINOv2 / DINOv2-with-registers / DINOv3 ViT weight layouts read into Meta's original
layout (which timm's converters take), every tensor of the file accounted for."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["HF_MODEL_TYPES", "HFWeights", "hf_config", "hf_to_meta", "hf_trunk"]

#: transformers' ``model_type`` of the ViTs read here.
HF_MODEL_TYPES = ("dinov2", "dinov2_with_registers", "dinov3_vit")
#: Tensors of a transformers file that are no part of a backbone: a classification head, a pooler.
_HEADS = re.compile(r"^(classifier|pooler|head)\.")
#: The block index in every naming transformers used: ``encoder.layer.N.`` (DINOv2), ``layer.N.`` (DINOv3 in
#: transformers 4.x files), ``model.layer.N.`` (DINOv3 in transformers 5).
_BLOCK = re.compile(r"^(?:encoder\.|model\.)?layer\.(\d+)\.(.+)$")
#: Within a block: transformers' names (4.x files and 5's) -> Meta's; q, k, v and the gated MLP are joined apart.
_IN_BLOCK = {
    "norm1.weight": "norm1.weight", "norm1.bias": "norm1.bias", "norm2.weight": "norm2.weight",
    "norm2.bias": "norm2.bias", "layer_scale1.lambda1": "ls1.gamma", "layer_scale2.lambda1": "ls2.gamma",
    "attention.output.dense.weight": "attn.proj.weight", "attention.output.dense.bias": "attn.proj.bias",
    "attention.o_proj.weight": "attn.proj.weight", "attention.o_proj.bias": "attn.proj.bias",
    "mlp.fc1.weight": "mlp.fc1.weight", "mlp.fc1.bias": "mlp.fc1.bias", "mlp.fc2.weight": "mlp.fc2.weight",
    "mlp.fc2.bias": "mlp.fc2.bias", "mlp.weights_in.weight": "mlp.w12.weight", "mlp.weights_in.bias": "mlp.w12.bias",
    "mlp.weights_out.weight": "mlp.w3.weight", "mlp.weights_out.bias": "mlp.w3.bias",
}
_QKV = {"query": "q", "key": "k", "value": "v", "q_proj": "q", "k_proj": "k", "v_proj": "v"}
_OUTSIDE = {
    "embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "embeddings.patch_embeddings.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.bias": "patch_embed.proj.bias",
    "layernorm.weight": "norm.weight", "layernorm.bias": "norm.bias", "norm.weight": "norm.weight",
    "norm.bias": "norm.bias",
}


class HFWeights:
    """A transformers file read into Meta's layout: ``state`` (Meta's keys), ``config`` (its ``config.json``),
    ``unused`` (the file's tensors that went nowhere, not counting a known head) and ``heads`` (those left out on
    purpose: a classifier, a pooler)."""

    def __init__(self, state: dict[str, torch.Tensor], config: dict[str, Any], unused: list[str],
                 heads: list[str]) -> None:
        self.state, self.config, self.unused, self.heads = state, config, unused, heads


def hf_config(path: str | Path) -> dict[str, Any] | None:
    """The ``config.json`` of a transformers checkpoint at ``path`` (its folder, or a weights file beside it) when
    its ``model_type`` is one read here, else None."""
    p = Path(path).expanduser()
    found = p / "config.json" if p.is_dir() else p.parent / "config.json"
    if not found.is_file():
        return None
    try:
        config = json.loads(found.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and config.get("model_type") in HF_MODEL_TYPES else None


def _strip(name: str, config: dict[str, Any]) -> str:
    """A classification model's key without its backbone's prefix (``dinov2.`` in ``Dinov2ForImageClassification``)."""
    for prefix in (f"{config.get('model_type', '')}.", "dinov2.", "dinov2_with_registers.", "dinov3_vit.", "dinov3."):
        if prefix != "." and name.startswith(prefix):
            return name[len(prefix):]
    return name


def hf_to_meta(state: dict[str, torch.Tensor], config: dict[str, Any]) -> HFWeights:
    """``state`` (a transformers ``Dinov2Model``, ``Dinov2WithRegistersModel`` or ``DINOv3ViTModel`` file, in the
    names of transformers 4.x or 5, or of their classification models) in the layout of Meta's own releases:
    q, k and v joined into ``qkv`` (a missing key bias, DINOv3's, as zeros: Meta's masked bias), the gated MLP's
    gate and up projections into ``w1`` / ``w2`` (DINOv3) or ``w12`` (DINOv2), registers as ``register_tokens``
    (DINOv2) or ``storage_tokens`` (DINOv3), the mask token ``[1, D]``."""
    dinov3 = config.get("model_type") == "dinov3_vit"
    out: dict[str, torch.Tensor] = {}
    unused, heads = [], []
    parts: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}  # q / k / v, the gated MLP's pieces
    for raw, value in state.items():
        name = _strip(raw, config)
        block = _BLOCK.match(name)
        if block:
            index, rest = int(block.group(1)), block.group(2)
            qkv = re.fullmatch(r"attention\.(?:attention\.)?(query|key|value|[qkv]_proj)\.(weight|bias)", rest)
            mlp = re.fullmatch(r"mlp\.(gate_proj|up_proj|down_proj)\.(weight|bias)", rest)
            if qkv:
                parts.setdefault((index, f"attn.qkv.{qkv.group(2)}"), {})[_QKV[qkv.group(1)]] = (raw, value)
            elif mlp:
                parts.setdefault((index, f"mlp.{mlp.group(2)}"), {})[mlp.group(1)] = (raw, value)
            elif rest in _IN_BLOCK:
                out[f"blocks.{index}.{_IN_BLOCK[rest]}"] = value
            else:
                unused.append(raw)
        elif name in _OUTSIDE:
            out[_OUTSIDE[name]] = value
        elif name == "embeddings.mask_token":
            out["mask_token"] = value.reshape(1, -1)
        elif name == "embeddings.register_tokens":
            if value.shape[1]:
                out["storage_tokens" if dinov3 else "register_tokens"] = value
        elif _HEADS.match(name):
            heads.append(raw)
        else:
            unused.append(raw)
    for (index, key), found in parts.items():
        joined = _joined(f"blocks.{index}.", key, {k: v for k, (_, v) in found.items()}, dinov3)
        if joined:
            out.update(joined)
        else:  # an incomplete q / k / v or MLP: named, never dropped
            unused.extend(raw for raw, _ in found.values())
    return HFWeights(out, config, sorted(unused), sorted(heads))


def _joined(at: str, key: str, found: dict[str, torch.Tensor], dinov3: bool) -> dict[str, torch.Tensor]:
    """One block's q / k / v (``key`` ``attn.qkv.weight|bias``) or MLP pieces (``mlp.weight|bias``) as Meta's
    tensors under the block prefix ``at``; empty when pieces are missing."""
    if key.startswith("attn.qkv"):
        if key.endswith("bias") and set(found) == {"q", "v"}:  # DINOv3: no key bias (Meta's masked, zero bias)
            found = {**found, "k": torch.zeros_like(found["q"])}
        return {at + key: torch.cat([found[p] for p in ("q", "k", "v")])} if set(found) == {"q", "k", "v"} else {}
    kind = key.split(".")[1]
    if set(found) == {"gate_proj", "up_proj", "down_proj"}:
        if dinov3:  # Meta's DINOv3 SwiGLU: w1 the gate, w2 the up projection, w3 down
            return {f"{at}mlp.w1.{kind}": found["gate_proj"], f"{at}mlp.w2.{kind}": found["up_proj"],
                    f"{at}mlp.w3.{kind}": found["down_proj"]}
        # Meta's DINOv2 SwiGLU: one w12, the gate's rows first
        return {f"{at}mlp.w12.{kind}": torch.cat([found["gate_proj"], found["up_proj"]]),
                f"{at}mlp.w3.{kind}": found["down_proj"]}
    if set(found) == {"up_proj", "down_proj"}:  # DINOv3's plain MLP
        return {f"{at}mlp.fc1.{kind}": found["up_proj"], f"{at}mlp.fc2.{kind}": found["down_proj"]}
    return {}


def hf_trunk(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The sslkit trunk a transformers DINOv2 / DINOv3 ``config.json`` describes: ``(trunk name, its arguments)``,
    an sslkit ViT of the config's width (DINOv2: LayerScale, registers) or timm's DINOv3 ViT with the config's
    width, depth, heads, patch, registers, biases, MLP and RoPE period. Raises ``ValueError`` for what sslkit's
    trunks cannot be (a width without an sslkit ViT, DINOv2's SwiGLU giant, a key bias)."""
    from sslkit.models.vit import VIT_SIZES

    width, kind = int(config["hidden_size"]), config["model_type"]
    common = {"patch_size": int(config["patch_size"]), "depth": int(config["num_hidden_layers"]),
              "num_heads": int(config["num_attention_heads"]), "in_channels": int(config.get("num_channels", 3))}
    if kind == "dinov3_vit":
        if config.get("key_bias"):
            raise ValueError("a key bias in the attention (key_bias: true), which timm's DINOv3 ViT has not")
        gated = bool(config.get("use_gated_mlp"))
        act = config.get("hidden_act", "gelu")
        if float(config.get("layer_norm_eps", 1e-5)) != 1e-5:
            raise ValueError(f"norms of eps {config['layer_norm_eps']} (timm's DINOv3 ViT: 1e-5)")
        if act != ("silu" if gated else "gelu"):  # timm's DINOv3 MLPs: GELU, or SwiGLU's SiLU gate
            raise ValueError(f"a{' gated' if gated else 'n'} MLP of {act} (timm's DINOv3 ViT has "
                             f"{'SiLU' if gated else 'GELU'} there)")
        return "vit_small_patch16_dinov3", {
            **common, "embed_dim": width, "num_reg_tokens": int(config.get("num_register_tokens", 0)),
            "qkv_bias": bool(config.get("query_bias", True) or config.get("value_bias", True)),
            "mlp_ratio": int(config["intermediate_size"]) / width, "swiglu_mlp": gated,
            **({"swiglu_align_to": 1} if gated else {}),  # timm's SwiGLU of separate gate and up weights, unrounded
            "init_values": float(config.get("layerscale_value", 1.0)),
            "rope_temperature": float(config.get("rope_theta", 100.0))}
    if config.get("hidden_act", "gelu") != "gelu" or float(config.get("layer_norm_eps", 1e-6)) != 1e-6:
        raise ValueError(f"an MLP of {config.get('hidden_act')} or norms of eps {config.get('layer_norm_eps')} "
                         "(sslkit's ViT: GELU, 1e-6)")
    if config.get("use_swiglu_ffn"):
        raise ValueError("DINOv2's SwiGLU MLP (the giant), which sslkit's ViT has not: read it with "
                         "timm:vit_giant_patch14_dinov2 in timm's own layout")
    size = next((name for name, (dim, *_) in VIT_SIZES.items() if dim == width), None)
    if size is None:
        widths = ", ".join(f"{n} ({d})" for n, (d, *_) in VIT_SIZES.items())
        raise ValueError(f"width {width}: sslkit's ViTs are {widths}")
    return size, {**common, "reg_tokens": int(config.get("num_register_tokens", 0)),
                  "layer_scale_init": float(config.get("layerscale_value", 1.0)),
                  "mlp_ratio": float(config.get("mlp_ratio", 4.0)), "qkv_bias": bool(config.get("qkv_bias", True))}
