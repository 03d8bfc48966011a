"""LoRA adapters on a trunk through peft, for continued pretraining that keeps a released backbone's weights: the
trunk's own tensors frozen, low-rank updates trained beside them, and merged into them for every tool and export."""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

from sslkit.errors import UserError

__all__ = ["LoraError", "add_lora", "has_lora", "merge_lora"]


class LoraError(UserError, ValueError):
    """LoRA settings that cannot be applied: peft missing, or targets that match no layer of the trunk."""


def _config(rank: int, alpha: float | None, dropout: float, targets: Sequence[str]) -> object:
    try:
        from peft import LoraConfig
    except ImportError:
        raise LoraError("model.lora.rank > 0 needs peft (Hugging Face's LoRA library), which is not installed: "
                        "pip install peft") from None
    pattern = rf".*\.({'|'.join(re.escape(t) for t in targets)})$"  # whole module names: not patch_embed.proj
    return LoraConfig(r=int(rank), lora_alpha=float(alpha if alpha is not None else rank),
                      lora_dropout=float(dropout), target_modules=pattern, bias="none")


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, dropout: float = 0.0,
             targets: Sequence[str] = ("attn.qkv", "attn.proj")) -> int:
    """LoRA (Hu et al. 2022, "LoRA: Low-Rank Adaptation of Large Language Models"; peft's ``inject_adapter_in_model``
    and its defaults: A from Kaiming-uniform, B zero, so the model starts as it was) on the layers of
    ``model.trunk`` whose names end with one of ``targets`` (the attention's qkv and output projections by
    default, as the paper's W_q, W_v, W_o), of rank ``rank`` and scale ``alpha / rank`` (``alpha`` None: the rank).
    Every other tensor of the trunk is frozen (the heads, outside it, still train). The trunk's copies (EMA and
    Gram teachers, the anchor) get the same layers and start equal to it, frozen: a momentum teacher follows the
    adapters and leaves the frozen weights as they are. Call it after the released weights are loaded. Returns the
    number of layers adapted; raises :class:`LoraError` when peft is missing or no layer matches."""
    from peft import inject_adapter_in_model

    config = _config(rank, alpha, dropout, targets)
    trunk = model.trunk
    try:
        inject_adapter_in_model(config, trunk)
    except ValueError as exc:  # peft: "Target modules ... not found in the base model"
        names = [n for n, m in trunk.named_modules() if isinstance(m, nn.Linear)][:6]
        raise LoraError(f"model.lora.targets={list(targets)} match no layer of the trunk ({str(exc)[:120]}); its "
                        f"linear layers are named like {', '.join(names)}") from None
    copies = model.trunk_copies() if hasattr(model, "trunk_copies") else []
    for copy in copies:
        inject_adapter_in_model(config, copy)
        copy.load_state_dict(trunk.state_dict())
        copy.requires_grad_(False)
    return sum(1 for m in trunk.modules() if _is_lora(m))


def _is_lora(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def has_lora(module: nn.Module) -> bool:
    """Whether ``module`` holds LoRA layers (without importing peft when it cannot: no peft, no LoRA)."""
    return any(type(m).__module__.startswith("peft.") for m in module.modules())


def merge_lora(module: nn.Module) -> nn.Module:
    """``module`` with every LoRA layer merged into its weight and replaced by that plain layer (in place): the same
    function, the tensor names of the network without adapters (what timm, transformers and the tools read)."""
    if not has_lora(module):
        return module
    for name, layer in list(module.named_modules()):
        if _is_lora(layer):
            layer.merge()
            parent, _, child = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, child, layer.get_base_layer())
    return module
