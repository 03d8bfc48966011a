"""The dense probe (``sslkit dense``): a linear segmentation head on a checkpoint's frozen ViT patch features, mIoU
into ``<run>/eval/dense.json``."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader, Dataset

from sslkit.builder import limited
from sslkit.data.segmentation import (
    FashionMNISTScenes,
    FashionMNISTSegmentation,
    SegmentationFolder,
    SegmentationTransform,
    TransformedSegmentation,
    folder_classes,
    split_scenes,
)
from sslkit.evaluation.dense import (
    LinearSegmentationHead,
    dense_lr,
    evaluate_dense,
    frozen_maps,
    on_device,
    train_dense_epoch,
    train_dense_head,
)
from sslkit.models.tokens import TokenTrunk
from sslkit.tools.common import (
    amp_dtype,
    features_part,
    output_path,
    parse_tool_args,
    part_module,
    run_tool,
    tool_pretrained,
    tool_usage,
    write_json,
)
from sslkit.tools.pretrained import ToolError

__all__ = ["DENSE_KEYS", "dense_image_size", "dense_main", "dense_window", "segmentation_sets"]

logger = logging.getLogger("sslkit")

#: The ``key=value`` arguments of ``sslkit dense`` that are not config keys.
DENSE_KEYS = {
    "checkpoint": "a run folder (its latest checkpoint) or a checkpoint file",
    "features": "trunk (default) | teacher: whose last-layer patch tokens the head reads",
    "output": "where the results JSON goes (default <run>/eval/dense.json)",
}


def _fashion_mnist(cfg: DictConfig, split: str) -> Any:
    from sslkit.data import build_source

    path = cfg.data.train.path if cfg.data.train.source == "fashion_mnist" else None
    return build_source("fashion_mnist", split, path)


def segmentation_sets(cfg: DictConfig) -> tuple[Dataset, Dataset, int, dict[str, Any]]:
    """The training and test segmentation sets ``eval.dense`` names, and their number of classes: ``scenes``
    (:class:`~sslkit.data.segmentation.FashionMNISTScenes` of ``eval.dense.scenes``, from the run's own
    Fashion-MNIST files), ``fashion_mnist`` (each pixel above ``eval.dense.threshold`` the image's class, else
    background) or ``folder`` (ADE20K's layout under ``eval.dense.path``; ``eval.dense.num_classes`` classes, or
    those its ``dataset.json`` states). ``eval.dense.train_samples`` keeps the first N training images (0: all),
    ``data.limit`` the first N of each split (:func:`~sslkit.builder.limited`). A folder whose class maps are not of
    their images' sizes is a :class:`ToolError` naming them."""
    dense = cfg.eval.dense
    if dense.dataset == "scenes":
        sc = dense.scenes
        sets = [split_scenes(src.images, src.labels, split, int(sc[split]), int(sc.canvas), tuple(sc.garments),
                             int(sc.jitter), float(dense.threshold), int(sc.seed))
                for split, src in (("train", _fashion_mnist(cfg, "train")), ("test", _fashion_mnist(cfg, "test")))]
        classes = FashionMNISTScenes.num_classes
        scene = OmegaConf.to_container(sc, resolve=True)
        assert isinstance(scene, dict)
        described = {"dataset": "scenes", **scene, "threshold": float(dense.threshold),
                     "classes": "0 background, 1 + the garment's label where its pixel is above the threshold, "
                                "faint pixels ignored"}
    elif dense.dataset == "fashion_mnist":
        sets = [FashionMNISTSegmentation(src.images, src.labels, float(dense.threshold))
                for src in (_fashion_mnist(cfg, "train"), _fashion_mnist(cfg, "test"))]
        classes = FashionMNISTSegmentation.num_classes
        described = {"dataset": "fashion_mnist", "threshold": float(dense.threshold),
                     "classes": "0 background, 1 + the image's label where the pixel is above the threshold"}
    elif dense.dataset == "folder":
        sets, classes, described = _folder_sets(dense)
    elif dense.dataset == "wild":
        sets, classes, described = _wild_sets(cfg)
    else:
        raise ToolError(f"eval.dense.dataset={dense.dataset}: use scenes, fashion_mnist, wild or folder")
    train, test = sets
    limit = int(cfg.data.limit)  # as every tool reads data.limit: the first N images of each split
    train = limited(limited(train, int(dense.train_samples)), limit)
    return train, limited(test, limit), classes, described


def _wild_sets(cfg: DictConfig) -> tuple[list[Dataset], int, dict[str, Any]]:
    """The class maps of the run's wild set (data=wild: its data.train.path, or the set its knobs built into the
    cache), or of the wild folder eval.dense.path names."""
    from sslkit.builder.common import section_kwargs
    from sslkit.data.sources import DataSourceError
    from sslkit.data.wild_files import wild_folder, wild_pairs

    path, kwargs = cfg.eval.dense.path, {}
    if not path:
        if cfg.data.train.source != "wild":
            raise ToolError("eval.dense.dataset=wild reads the class maps of the run's wild set (data=wild), or of "
                            f"eval.dense.path=DIR (a folder `sslkit data wild` wrote); this run's data is "
                            f"{cfg.data.train.source}")
        path, kwargs = cfg.data.train.path, section_kwargs(cfg.data.train.kwargs, ())
    kwargs.pop("channels", None)
    try:
        root = wild_folder(str(path) if path else None, **kwargs)
        sets = [SegmentationFolder.from_pairs(wild_pairs(root, split)) for split in ("train", "test")]
    except (DataSourceError, FileNotFoundError) as exc:
        raise ToolError(f"eval.dense.dataset=wild: {exc}") from None
    return sets, 11, {"dataset": "wild", "path": str(root),  # type: ignore[return-value]
                      "classes": "0 background, 1 + the class of the garment a pixel belongs to (the labelled one "
                                 "or a distractor), faint pixels ignored"}


def _folder_sets(dense: DictConfig) -> tuple[list[Dataset], int, dict[str, Any]]:
    if not dense.path:
        raise ToolError("eval.dense.dataset=folder needs eval.dense.path: a folder in ADE20K's layout "
                        "(images/training, annotations/training, images/validation, annotations/validation)")
    try:
        sets = [SegmentationFolder(str(dense.path), split, bool(dense.reduce_zero_label))
                for split in ("train", "test")]
    except FileNotFoundError as exc:
        raise ToolError(f"eval.dense.path={dense.path}: {exc}") from None
    classes = int(dense.num_classes or folder_classes(str(dense.path)) or 0)
    if not classes:
        raise ToolError(f"eval.dense.dataset=folder needs eval.dense.num_classes (150 for ADE20K): {dense.path} has "
                        "no dataset.json that says it")
    for split, folder in zip(("train", "test"), sets):
        bad = folder.mismatched()
        if bad:
            raise ToolError(f"eval.dense.path={dense.path}: {len(bad)} class map(s) of the {split} split are not of "
                            f"their image's size: {', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}")
    return sets, classes, {"dataset": "folder", "path": str(dense.path),  # type: ignore[return-value]
                           "reduce_zero_label": bool(dense.reduce_zero_label)}


def dense_window(setting: Any, native: int, size: int) -> int | None:
    """The window a trunk reads the dense images through (``eval.dense.window``): ``auto`` its own image size
    (``native``), a number that many pixels, null none; None too when the images (``size``) are no larger."""
    if setting is None:
        return None
    window = int(native) if setting == "auto" else int(setting)
    return window if window < size else None


def dense_image_size(cfg: DictConfig) -> int:
    """The side images and class maps are resized to: ``eval.dense.image_size``, else the scenes' canvas (their
    garments at the scale the run trained on), else ``data.image_size``."""
    dense = cfg.eval.dense
    if dense.image_size:
        return int(dense.image_size)
    return int(dense.scenes.canvas) if dense.dataset == "scenes" else int(cfg.data.image_size)


def _loader(dataset: Dataset, transform: SegmentationTransform, batch: int, shuffle: bool, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(TransformedSegmentation(dataset, transform), batch_size=batch, shuffle=shuffle,
                      generator=generator, num_workers=0, drop_last=False)


def _maps_once(trunk: TokenTrunk, loader: DataLoader, device: torch.device, amp: torch.dtype | None,
               window: int | None) -> tuple[Any, Any]:
    """Every training image's patch map (float16) and class map (uint8 where the classes fit), on the CPU: the maps
    every epoch would read again (the trunk is frozen, nothing is augmented)."""
    maps, masks = [], []
    trunk.eval()
    for images, target in on_device(loader, device):
        maps.append(frozen_maps(trunk, images, amp, window).half().cpu())
        masks.append(target.cpu().to(torch.uint8 if int(target.max()) <= 255 else torch.int64))
    return torch.cat(maps).numpy(), torch.cat(masks).numpy()


def _train_head(trunk: TokenTrunk, head: nn.Module, dataset: Dataset, transform: SegmentationTransform,
                dense: DictConfig, device: torch.device, amp: torch.dtype | None, window: int | None,
                seed: int) -> list[dict[str, Any]]:
    """The head trained over ``eval.dense.epochs``: on the training maps extracted once when they take at most
    ``eval.dense.cache_gb`` (:func:`~sslkit.evaluation.dense.train_dense_head`), else read by the trunk every epoch.
    Returns each epoch's mean loss."""
    batch, epochs = int(dense.batch_size), int(dense.epochs)
    optimizer = torch.optim.AdamW(head.parameters(), lr=float(dense.lr), betas=(0.9, 0.999),
                                  weight_decay=float(dense.weight_decay))
    total = -(-len(dataset) // batch) * epochs  # type: ignore[arg-type]
    warmup = min(int(dense.warmup_steps), total // 10)

    def lr_at(t: int) -> float:
        return dense_lr(float(dense.lr), t, warmup, total)
    grid = transform.size // trunk.patch_size
    if len(dataset) * int(trunk.out_dim) * grid * grid * 2 <= float(dense.cache_gb) * 1e9:  # type: ignore[arg-type]
        maps, masks = _maps_once(trunk, _loader(dataset, transform, batch, False, seed), device, amp, window)
        losses = train_dense_head(maps, masks, head, optimizer, lr_at, epochs, batch, device, seed)
    else:
        loader, step, losses = _loader(dataset, transform, batch, True, seed), 0, []
        for _ in range(epochs):
            loss, step = train_dense_epoch(trunk, head, optimizer, on_device(loader, device), lr_at, step, amp,
                                           window)
            losses.append(loss)
    for epoch, loss in enumerate(losses):
        logger.info("dense epoch %d/%d: train loss %.4f", epoch + 1, epochs, loss)
    return [{"epoch": e + 1, "train_loss": round(v, 6)} for e, v in enumerate(losses)]


def _dense(args: list[str]) -> int:
    opts, overrides = parse_tool_args("dense", args, DENSE_KEYS)
    pre = tool_pretrained("dense", opts, overrides)
    cfg = pre.config
    trunk = part_module(pre, features_part(opts, ("trunk", "teacher")))
    if not isinstance(trunk, TokenTrunk):
        raise ToolError(f"sslkit dense reads a ViT's patch tokens, and model.trunk={cfg.model.trunk} gives none: it "
                        "probes ViT runs (dinov2, dinov3, ibot, mae, ...)")
    dense, device, amp = cfg.eval.dense, pre.device, amp_dtype(cfg)
    train_set, test_set, classes, described = segmentation_sets(cfg)
    size = dense_image_size(cfg)
    if size % trunk.patch_size:
        raise ToolError(f"eval.dense.image_size={size} is not a multiple of the trunk's {trunk.patch_size} px "
                        f"patches: use {size // trunk.patch_size * trunk.patch_size} or "
                        f"{(size // trunk.patch_size + 1) * trunk.patch_size}")
    native = int(cfg.data.eval_transform.get("image_size", cfg.data.image_size))
    window = dense_window(dense.window, native, size)
    if window and window % trunk.patch_size:
        raise ToolError(f"eval.dense.window={window} is not a multiple of the trunk's {trunk.patch_size} px patches")
    transform = SegmentationTransform(size, cfg.data.eval_transform.get("mean"), cfg.data.eval_transform.get("std"),
                                      channels=int(trunk.in_channels))
    seed, batch = int(cfg.seed), int(dense.batch_size)
    torch.manual_seed(seed)
    dim = int(trunk.out_dim)
    head = LinearSegmentationHead(dim, classes, float(dense.dropout)).to(device)
    start = time.perf_counter()
    logger.info("dense: a linear head (Dropout2d, BatchNorm, 1x1 conv) on the frozen %s's patch tokens, %d classes, "
                "%d training and %d test images at %d px%s, %d epoch(s)", opts.get("features", "trunk"), classes,
                len(train_set), len(test_set), size, f" in windows of {window} px" if window else "",  # type: ignore[arg-type]
                int(dense.epochs))
    records = _train_head(trunk, head, train_set, transform, dense, device, amp, window, seed)
    metrics = evaluate_dense(trunk, head, on_device(_loader(test_set, transform, batch, False, seed), device),
                             classes, amp, window)
    record = {**metrics, "num_classes": classes, "num_train": len(train_set), "num_test": len(test_set),  # type: ignore[arg-type]
              "step": pre.step, "checkpoint": pre.path, "feature_dim": dim,
              "time_s": round(time.perf_counter() - start, 2), "epochs": records,
              "config": {"protocol": "DINOv3's linear segmentation (eval/segmentation, config-ade20k-linear-training."
                                     "yaml): Dropout2d 0.1, BatchNorm, 1x1 conv on the last layer's normed patch "
                                     "tokens, logits upsampled bilinearly, cross-entropy, AdamW (0.9, 0.999), "
                                     "warm-up then cosine; images and class maps resized to image_size x image_size, "
                                     "read through windows of the run's own size side by side when larger",
                         **described, "features": opts.get("features", "trunk"), "image_size": size,
                         "window": window,
                         **{k: v for k, v in OmegaConf.to_container(dense, resolve=True).items()  # type: ignore[union-attr]
                            if k not in ("dataset", "path", "image_size", "window")}}}
    out = output_path(opts, pre, "dense.json")
    write_json(out, record)
    logger.info("dense probe of step %d: mIoU %.4f, pixel accuracy %.4f; written to %s", pre.step, metrics["miou"],
                metrics["pixel_accuracy"], out)
    return 0


def dense_main(argv: list[str] | None = None) -> int:
    """``sslkit dense checkpoint=RUN_DIR [eval.dense.epochs=2] [eval.dense.dataset=folder eval.dense.path=...]``"""
    return run_tool("dense", _dense, argv, tool_usage(
        "dense", "a linear segmentation head on the frozen ViT's patch tokens (DINOv3's linear protocol), mIoU into "
        "<run>/eval/dense.json (eval.dense.*: Fashion-MNIST's garments against their background, or a folder in "
        "ADE20K's layout)", DENSE_KEYS))
