"""Fine-tuning: the whole trunk and a linear head trained on labels, MAE's protocol (``sslkit finetune``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import Tensor, nn

from sslkit.errors import plural
from sslkit.evaluation.features import extract_features
from sslkit.evaluation.linear import accuracy, warmup_cosine_lr
from sslkit.files import atomic_write
from sslkit.models.tokens import TokenTrunk
from sslkit.optim import build_optimizer, set_lr
from sslkit.tools.common import (
    amp_dtype,
    describe_data,
    epochs_record,
    feature_encoder,
    feature_record,
    features_part,
    output_path,
    parse_tool_args,
    part_module,
    run_tool,
    tool_loader,
    tool_pretrained,
    tool_sources,
    tool_usage,
    train_crop,
    write_json,
)
from sslkit.tools.pretrained import Pretrained, ToolError

__all__ = ["Classifier", "FinetuneSettings", "finetune_main", "make_head", "make_optimizer", "set_drop_path",
           "settings_of", "smoothed_cross_entropy", "train_epoch"]

logger = logging.getLogger("sslkit")

#: The ``key=value`` arguments of ``sslkit finetune`` that are not config keys.
FINETUNE_KEYS = {
    "checkpoint": "a run folder (its latest checkpoint) or a checkpoint file",
    "features": "trunk (default) | teacher (the momentum encoder of BYOL, MoCo, DINO); a ViT's head reads "
                "eval.vit_features",
    "output": "where the results JSON goes (default <run>/eval/finetune.json; the state file goes next to it)",
}

#: MAE's layer-wise lr decay (main_finetune.py's default; the paper's Table 9), what ``layer_decay: null`` gives a ViT.
MAE_LAYER_DECAY = 0.75


@dataclass(frozen=True)
class FinetuneSettings:
    """What fine-tuning's result depends on besides the trunk and the data (``eval.finetune``, resolved)."""

    epochs: int = 100
    batch_size: int = 1024
    blr: float = 1e-3
    min_lr: float = 1e-6
    warmup_epochs: float = 5
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    layer_decay: float = MAE_LAYER_DECAY
    drop_path: float = 0.1
    smoothing: float = 0.1
    head_init_std: float = 2e-5
    crop_scale: tuple[float, float] = (0.08, 1.0)

    @property
    def lr(self) -> float:
        """The peak learning rate: ``blr x batch_size / 256`` (MAE's linear scaling rule)."""
        return self.blr * self.batch_size / 256


def settings_of(section: Any, vit: bool) -> FinetuneSettings:
    """:class:`FinetuneSettings` from the ``eval.finetune`` config section; ``layer_decay: null`` is MAE's 0.75 for a
    ViT (``vit``) and 1.0 (off) for a CNN, whose layers have no order to decay along."""
    decay = section.layer_decay
    decay = (MAE_LAYER_DECAY if vit else 1.0) if decay is None else float(decay)
    return FinetuneSettings(epochs=int(section.epochs), batch_size=int(section.batch_size), blr=float(section.blr),
                            min_lr=float(section.min_lr), warmup_epochs=float(section.warmup_epochs),
                            weight_decay=float(section.weight_decay),
                            betas=(float(section.betas[0]), float(section.betas[1])), layer_decay=decay,
                            drop_path=float(section.drop_path), smoothing=float(section.smoothing),
                            head_init_std=float(section.head_init_std),
                            crop_scale=(float(section.crop_scale[0]), float(section.crop_scale[1])))


def set_drop_path(trunk: nn.Module, rate: float) -> list[float]:
    """Stochastic depth for fine-tuning a ViT: block ``i`` of ``L`` drops its residual branches with probability
    ``rate * i / (L - 1)``, timm's linear rule (``calculate_drop_path_rates``, what ``drop_path_rate=rate`` builds).
    The blocks' ``drop_path1`` / ``drop_path2`` become timm ``DropPath`` modules (``nn.Identity`` at 0), whatever the
    trunk was pretrained with; they hold no weights, so the state dict does not change. Returns the rates."""
    from timm.layers import DropPath, calculate_drop_path_rates

    blocks = list(trunk.blocks)  # type: ignore[arg-type]
    rates = calculate_drop_path_rates(float(rate), len(blocks))
    for block, p in zip(blocks, rates, strict=True):
        for name in ("drop_path1", "drop_path2"):
            if hasattr(block, name):
                setattr(block, name, DropPath(p) if p > 0 else nn.Identity())
    return [float(p) for p in rates]


def make_head(dim: int, num_classes: int, std: float, device: torch.device) -> nn.Linear:
    """The classifier ``nn.Linear(dim, num_classes)``: weights from a truncated normal of ``std`` (MAE:
    ``trunc_normal_(head.weight, std=2e-5)``), bias zero. Draws from torch's global RNG."""
    head = nn.Linear(dim, num_classes, device=device, dtype=torch.float32)
    nn.init.trunc_normal_(head.weight, std=std, a=-2 * std, b=2 * std)
    nn.init.zeros_(head.bias)
    return head


class Classifier(nn.Module):
    """An encoder (:class:`~sslkit.evaluation.features.FeatureEncoder`) and a linear head on its flattened
    features: the network fine-tuning trains. Its state dict is ``encoder.trunk.*`` and ``head.*``."""

    def __init__(self, encoder: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head

    def forward(self, x: Tensor) -> Tensor:
        """Class logits ``[B, num_classes]``."""
        return self.head(self.encoder(x).reshape(x.shape[0], -1))


def make_optimizer(model: nn.Module, s: FinetuneSettings) -> torch.optim.AdamW:
    """AdamW with MAE's parameter groups: no weight decay on biases, norms, position embeddings and tokens, and a
    ViT's layer ``l`` of ``L`` at ``layer_decay ** (L - l)`` times the learning rate (the head at 1)."""
    return build_optimizer(model, "adamw", s.lr, weight_decay=s.weight_decay, betas=s.betas,  # type: ignore[return-value]
                           layer_decay=s.layer_decay)


def smoothed_cross_entropy(logits: Tensor, target: Tensor, smoothing: float) -> Tensor:
    """Cross-entropy with label smoothing (timm's ``LabelSmoothingCrossEntropy``, MAE's loss without mixup): the mean
    over rows of ``(1 - s) * -log p[target] + s * mean_c(-log p[c])``. Written with ``log_softmax`` and ``gather``
    (as :func:`sslkit.methods.infonce.cross_entropy_at`), which have deterministic CUDA kernels where
    ``F.cross_entropy``'s ``NLLLoss`` raises under ``torch.use_deterministic_algorithms(True)``. Float32."""
    log_p = F.log_softmax(logits.float(), dim=1)
    nll = -log_p.gather(1, target.unsqueeze(1)).squeeze(1)
    return ((1.0 - smoothing) * nll - smoothing * log_p.mean(dim=1)).mean()


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Iterable[dict[str, Any]],
                lr_at: Callable[[int], float], first_step: int, smoothing: float, device: torch.device,
                amp: torch.dtype | None = None, scaler: torch.amp.GradScaler | None = None) -> tuple[float, int]:
    """One epoch of ``model`` in train mode on the first view of each batch of ``loader``; the learning rate of step
    ``t`` is ``lr_at(t)`` (times each group's ``lr_scale``), counting from ``first_step``. ``amp``: autocast dtype;
    ``scaler``: a GradScaler for float16. Returns the mean loss (one host sync, at the end) and the next step."""
    model.train()
    total = torch.zeros((), dtype=torch.float64, device=device)
    seen, step = 0, first_step
    for batch in loader:
        set_lr(optimizer, lr_at(step))
        x = batch["input"][0].to(device, non_blocking=True)
        y = batch["target"].reshape(-1).to(device, non_blocking=True)
        with torch.autocast(device.type, amp) if amp else contextlib.nullcontext():
            logits = model(x)
        loss = smoothed_cross_entropy(logits, y, smoothing)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        total += loss.detach().double() * y.shape[0]
        seen += y.shape[0]
        step += 1
    return total.item() / max(seen, 1), step


# ----------------------------------------------------------------------------------------------------
# The tool
# ----------------------------------------------------------------------------------------------------


def _rng_state(device: torch.device) -> dict[str, Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _resume(path: str, key: str, model: nn.Module, optimizer: torch.optim.Optimizer,
            scaler: torch.amp.GradScaler | None, device: torch.device
            ) -> tuple[list[dict[str, Any]], int, int, dict[str, Tensor]]:
    """The state file at ``path``, loaded into ``model``, ``optimizer`` and ``scaler`` when it was written with these
    settings (``key``): ``(records, epochs done, next step, RNG state)``; else nothing is loaded and the RNG state is
    the present one (a fresh start)."""
    from sslkit.checkpoint import Checkpointer

    if os.path.exists(path):
        saved = Checkpointer.read(path)
        if saved.get("key") == key:
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            if scaler is not None and saved.get("scaler"):
                scaler.load_state_dict(saved["scaler"])
            return list(saved["records"]), int(saved["epoch"]), int(saved["step"]), saved["rng"]
        logger.info("finetune: %s is of another checkpoint or other settings; starting afresh", path)
    return [], 0, 0, _rng_state(device)


def _finetune(args: list[str]) -> int:
    from sslkit.builder import set_determinism

    opts, overrides = parse_tool_args("finetune", args, FINETUNE_KEYS)
    pre: Pretrained = tool_pretrained("finetune", opts, overrides)
    cfg = pre.config
    part = features_part(opts, ("trunk", "teacher"))
    trunk = part_module(pre, part)
    vit = isinstance(trunk, TokenTrunk)
    section = cfg.eval.finetune
    s = settings_of(section, vit)
    if not vit and s.layer_decay != 1.0:
        raise ToolError(f"eval.finetune.layer_decay={section.layer_decay}: layer-wise lr decay needs a ViT's ordered "
                        f"blocks, and model.trunk={cfg.model.trunk} has none. Set eval.finetune.layer_decay=1.0 (or "
                        "null, the default: 0.75 for a ViT, 1.0 for a CNN).")
    device, amp = pre.device, amp_dtype(cfg)
    set_determinism(bool(cfg.machine.deterministic), device)
    train_source, test_source, num_classes = tool_sources(pre)
    encoder = feature_encoder(trunk, cfg)
    rates = set_drop_path(trunk, s.drop_path) if vit else None
    for p in encoder.parameters():  # every weight trains (a teacher's are frozen in the checkpoint's model)
        p.requires_grad_(True)
    seed = int(cfg.seed)
    torch.manual_seed(seed)  # the head's initialisation; then the drop-path masks
    dim = int(encoder.out_dim)  # type: ignore[arg-type]  (every sslkit trunk says it: the heads are built on it)
    model = Classifier(encoder, make_head(dim, num_classes, s.head_init_std, device))
    optimizer = make_optimizer(model, s)
    scaler = torch.amp.GradScaler(device.type) if amp == torch.float16 else None

    train_loader = tool_loader(cfg, train_source, train_crop(cfg, s.crop_scale), device, s.batch_size, train=True)
    test_loader = tool_loader(cfg, test_source, cfg.data.eval_transform, device, s.batch_size)
    for loader in (train_loader, test_loader):
        # a loader's iterator draws its workers' base seed from torch's global RNG unless it has a generator of its
        # own: with persistent workers that draw happens in the first epoch of a start, so a resumed run's drop-path
        # masks would differ from an uninterrupted run's (the augmentations are seeded by (seed, epoch, index))
        loader.generator = torch.Generator().manual_seed(seed)
    steps_per_epoch = len(train_loader)
    total = steps_per_epoch * s.epochs
    warmup = round(s.warmup_epochs * steps_per_epoch)

    def lr_at(t: int) -> float:
        return warmup_cosine_lr(s.lr, t, warmup, total, min_lr=s.min_lr)

    out = output_path(opts, pre, "finetune.json")
    state_path = os.path.splitext(out)[0] + ".state.pt"
    eval_cfg = {"protocol": "MAE end-to-end fine-tuning (He et al. 2022, Table 9; facebookresearch/mae "
                            "main_finetune.py) without mixup, cutmix, RandAugment and random erasing",
                **{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(s).items()}, "lr": s.lr,
                "layer_decay_setting": section.layer_decay, "drop_path": s.drop_path if vit else None,
                "drop_path_per_block": rates, "optimizer": "AdamW, no weight decay on biases, norms, position "
                "embeddings and tokens", "schedule": "linear warmup, then cosine to min_lr, per step",
                "loss": "cross-entropy with label smoothing", "head": "nn.Linear, trunc_normal(std) weights, zero bias",
                "augment": "random resized crop (crop_scale) and flip; test: the eval transform",
                "features": part, **feature_record(encoder), "steps_per_epoch": steps_per_epoch,
                "amp": str(amp).replace("torch.", "") if amp else None, "data": describe_data(cfg), "seed": seed,
                "eval_transform": OmegaConf.to_container(cfg.data.eval_transform, resolve=True)}
    key = json.dumps({"step": pre.step, "checkpoint": os.path.abspath(pre.path), **eval_cfg}, sort_keys=True)

    records, done_epochs, step, rng = _resume(state_path, key, model, optimizer, scaler, device)
    if done_epochs:
        logger.info("finetune: resuming from epoch %d of %d (%s)", done_epochs, s.epochs, state_path)
    logger.info("finetune: %s (%s) and a linear head to %d classes, %s of %s, lr %.3g (blr %g x %d / "
                "256), layer decay %g, drop path %s, label smoothing %g", type(trunk).__name__, part, num_classes,
                plural(s.epochs, "epoch"), plural(steps_per_epoch, "step"), s.lr, s.blr, s.batch_size, s.layer_decay,
                s.drop_path if vit else "- (a CNN)", s.smoothing)
    start = time.perf_counter()
    _set_rng_state(rng, device)  # last, right before the epochs: nothing above may draw after it
    for epoch in range(done_epochs, s.epochs):
        train_loader.sampler.set_epoch(epoch)
        loss, step = train_epoch(model, optimizer, train_loader, lr_at, step, s.smoothing, device, amp, scaler)
        features, labels = extract_features(model.encoder, test_loader, device, amp, normalize=False)
        acc = accuracy(model.head, features.to(device), labels.to(device), num_classes)
        records.append({"epoch": epoch + 1, "train_loss": round(loss, 6), "lr": lr_at(step), **acc})
        logger.info("finetune epoch %d/%d: train loss %.4f, test top-1 %.4f%s", epoch + 1, s.epochs, loss,
                    acc["top1"], f", top-5 {acc['top5']:.4f}" if "top5" in acc else "")
        state = {"key": key, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scaler": scaler.state_dict() if scaler is not None else None, "records": records,
                 "epoch": epoch + 1, "step": step, "rng": _rng_state(device)}
        atomic_write(state_path, lambda f, st=state: torch.save(st, f))
        write_json(out, epochs_record(records, pre, s.epochs, eval_cfg, start, dim, num_classes, len(test_source)))
    record = epochs_record(records, pre, s.epochs, eval_cfg, start, dim, num_classes, len(test_source))
    write_json(out, record)
    logger.info("fine-tuning of step %d: top-1 %.4f%s after %s; written to %s (the fine-tuned weights: %s)",
                pre.step, record["top1"], f", top-5 {record['top5']:.4f}" if record.get("top5") is not None else "",
                plural(s.epochs, "epoch"), out, state_path)
    return 0


def finetune_main(argv: list[str] | None = None) -> int:
    """``sslkit finetune checkpoint=RUN_DIR [eval.finetune.epochs=50] [eval.finetune.blr=5e-4] ...``"""
    return run_tool("finetune", _finetune, argv, tool_usage(
        "finetune", "the whole trunk and a linear head trained on labels (MAE's fine-tuning protocol: AdamW, "
        "layer-wise lr decay, drop path, label smoothing, warmup and cosine), top-1/top-5 per epoch into "
        "<run>/eval/finetune.json; resumes from its last epoch (eval.finetune.*)", FINETUNE_KEYS))
