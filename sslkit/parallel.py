"""distributed.strategy=fsdp: activation checkpointing, per-block compile and FSDP2 sharding of a built model.

One function, :func:`parallelize`, turns a built sslkit model into what the strategy trains, in the order
torchtitan and DINOv3 use: activation checkpointing of each transformer block, ``torch.compile`` of each block,
then ``fully_shard`` (FSDP2) of each block, of each module that owns blocks (trunks, MAE's decoder, I-JEPA's
predictor, and their EMA teachers: the same mesh and layout, so the momentum update is local to each shard), and
last of the root. The model and method code know nothing of it: parameter names stay what they were (the
checkpoint keys, the layer-wise lr groups and the freeze globs read them), and a teacher's parameters are sharded
exactly as its student's. The checkpoint helpers here read and write full (unsharded) states through
``torch.distributed.checkpoint.state_dict``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "block_owners",
    "checkpoint_activations",
    "full_model_state",
    "full_optimizer_state",
    "full_tensor",
    "gradient_sync",
    "is_sharded",
    "load_full_model_state",
    "load_optimizer_state",
    "parallelize",
    "transformer_blocks",
]


def _blocks(module: nn.Module) -> nn.ModuleList | nn.Sequential | None:
    """``module``'s ``blocks`` container (``nn.ModuleList`` or ``nn.Sequential``, as in timm's VisionTransformer,
    MAE's decoder and I-JEPA's predictor), None if it has none."""
    blocks = getattr(module, "blocks", None)
    return blocks if isinstance(blocks, (nn.ModuleList, nn.Sequential)) else None


def transformer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every transformer block of ``model``: the elements of each :func:`_blocks` container, by full name."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if (blocks := _blocks(module)) is not None:
            prefix = f"{name}.blocks" if name else "blocks"
            found += [(f"{prefix}.{i}", block) for i, block in enumerate(blocks)]
    return found


def block_owners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules of ``model`` (not ``model`` itself) that own a ``blocks`` container: trunks, teachers'
    trunks, decoders, predictors. Each becomes its own FSDP unit so that it can run on its own (kNN and the
    monitors call the trunk directly), deepest first."""
    owners = [(name, m) for name, m in model.named_modules() if name and _blocks(m) is not None]
    return sorted(owners, key=lambda item: -item[0].count("."))


def checkpoint_activations(block: nn.Module) -> None:
    """Recompute ``block``'s activations in backward instead of keeping them (non-reentrant
    ``torch.utils.checkpoint``), in place: its forward is wrapped, its parameter names stay the same."""
    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation and teachers: nothing to keep, nothing to recompute
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed  # type: ignore[method-assign]


def parallelize(model: nn.Module, *, strategy: str, device: torch.device, world_size: int,
                activation_checkpointing: bool = False, compile_kwargs: dict[str, Any] | None = None,
                param_dtype: torch.dtype | None = None) -> nn.Module:
    """Apply, in place and in this order, activation checkpointing to every transformer block (when asked),
    ``torch.compile`` to every block (``compile_kwargs``: ``backend`` and ``mode``; None: no compile) and, under
    ``strategy="fsdp"`` with more than one process, FSDP2: ``fully_shard`` on each block, on each module that
    owns blocks, then on the root, on a 1-D mesh of ``device``'s type (an explicit CPU mesh on the CPU).

    ``param_dtype`` (bf16 under ``amp.enabled``) is the dtype parameters are all-gathered in for forward and
    backward; gradients are reduce-scattered in float32 and the sharded parameters and optimizer state stay
    float32. Returns ``model`` (the same object, now an ``FSDPModule`` under fsdp). Raises ``ValueError`` when
    fsdp is asked for a model without transformer blocks."""
    blocks = transformer_blocks(model)
    if activation_checkpointing:
        for _, block in blocks:
            checkpoint_activations(block)
    if compile_kwargs is not None:
        for _, block in blocks:
            block.compile(**compile_kwargs)
    if strategy != "fsdp" or world_size < 2:
        return model
    if not blocks:
        raise ValueError("no transformer blocks to shard")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # each rank built its model from its own seed (seed + rank); DDP broadcasts rank 0's at construction, FSDP
    # shards what each rank holds: start every rank from rank 0's weights, as DDP does
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data if isinstance(tensor, nn.Parameter) else tensor, src=0)
    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs: dict[str, Any] = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    owners = block_owners(model)
    for _, block in blocks:
        fully_shard(block, **kwargs)
    for _, owner in owners:
        fully_shard(owner, **kwargs)
    fully_shard(model, **kwargs)
    # FSDP2 takes the first module to run forward as its root. kNN baselines and monitors call the trunk on its
    # own, possibly before the first training step: settle the root now, on the model.
    model._get_fsdp_state()._lazy_init()  # type: ignore[operator]
    logger.info("distributed.strategy=fsdp: FSDP2 over %d processes (%s mesh), %d transformer block(s) and %d "
                "block owner(s) sharded as units, then the root; parameters gathered in %s, gradients reduced in "
                "float32", world_size, device.type, len(blocks), len(owners),
                str(param_dtype).replace("torch.", "") if param_dtype else "float32")
    return model


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x`` whole: a DTensor's ``full_tensor()`` (a collective over its mesh), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` was sharded by :func:`parallelize` (an FSDP2 module)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """FSDP2's counterpart of DDP's ``no_sync``: with ``enabled=False`` the backward inside keeps unsharded
    gradients and reduces nothing (gradient accumulation); the next backward with sync reduces them all."""
    model.set_requires_gradient_sync(enabled)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """The unsharded state dict of a sharded ``model`` on rank 0, on the CPU (an empty dict on the other ranks).
    A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The unsharded optimizer state of a sharded ``model`` on rank 0, keyed by parameter name, on the CPU (an
    empty dict on the other ranks). A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(full_state_dict=True, cpu_offload=True))


def load_full_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Load an unsharded state dict (every rank holds it) into a sharded ``model``: each rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options(full_state_dict=True))


def _named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()``-style ``state`` (parameters numbered in param-group order, as a DDP run writes
    it) keyed by parameter name instead, the form ``torch.distributed.checkpoint.state_dict`` reads."""
    names = {id(p): name for name, p in model.named_parameters()}
    number_to_name: dict[int, str] = {}
    for saved, group in zip(state["param_groups"], optimizer.param_groups, strict=True):
        for number, param in zip(saved["params"], group["params"], strict=True):
            number_to_name[number] = names[id(param)]
    groups = [{**g, "params": [number_to_name[n] for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {number_to_name[n]: v for n, v in state["state"].items()}, "param_groups": groups}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an unsharded optimizer state into ``optimizer``, whichever way it was written and is trained now:
    numbered parameters (``optimizer.state_dict()``: a DDP or one-process run) or named ones (a gathered FSDP
    state), into a sharded ``model`` (each rank keeps its shards) or a whole one. Every rank holds ``state``."""
    named = any(isinstance(g, str) for group in state["param_groups"] for g in group["params"])
    if not is_sharded(model) and not named:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not named:
        state = _named_optimizer_state(model, optimizer, state)
    # strict=False: a parameter that has had no gradient yet (DINO's last layer, frozen for the first epoch) has
    # no AdamW state, in the checkpoint or in an uninterrupted run; the model's own load stays strict
    tuples = [{k for k, v in group.items() if isinstance(v, tuple)} for group in optimizer.param_groups]
    set_optimizer_state_dict(model, optimizer, state, options=_options(full_state_dict=True, strict=False))
    restore_tuples(optimizer, tuples)
    drop_unsaved_optimizer_state(model, optimizer, set(state["state"]))


def restore_tuples(optimizer: torch.optim.Optimizer, tuples: list[set[str]]) -> None:
    """Make the param-group options named in ``tuples`` (one set per group, taken before a load) tuples again:
    ``set_optimizer_state_dict`` hands AdamW's betas back as a list."""
    for group, keys in zip(optimizer.param_groups, tuples, strict=True):
        group.update({k: tuple(group[k]) for k in keys if isinstance(group.get(k), list)})


def drop_unsaved_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: set[str]) -> None:
    """Drop the optimizer state of every parameter of ``model`` whose name is not in ``saved``.
    ``torch.distributed.checkpoint.state_dict`` creates every parameter's state with a zero-gradient step before a
    load; where the checkpoint had none (a parameter with no gradient yet), the first real step would then count
    as the second (Adam's bias correction) and the resumed run would leave the uninterrupted one."""
    for name, param in model.named_parameters():
        if name not in saved:
            optimizer.state.pop(param, None)
