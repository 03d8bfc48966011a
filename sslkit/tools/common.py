"""Tools on a trained checkpoint: ``sslkit knn``, ``sslkit linear``, ``sslkit extract`` (and tools/*.py), and what
every tool shares (arguments, errors, the checkpoint, loaders, the features read, results files)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from sslkit.config.schema import schema
from sslkit.console import debug_flag, end_worker, launch_workers, setup_logging
from sslkit.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    STORAGE_ERRNOS,
    UserError,
    did_you_mean,
    plural,
    storage_error,
)
from sslkit.evaluation.features import FeatureEncoder, extract_features
from sslkit.evaluation.knn import weighted_knn
from sslkit.evaluation.linear import (
    accuracy,
    cosine_lr,
    feature_batches,
    make_classifier,
    make_optimizer,
    settings_of,
    train_epoch,
)
from sslkit.files import atomic_write
from sslkit.registry import UnknownNameError
from sslkit.tools.pretrained import Pretrained, ToolError, load_pretrained, select_student

__all__ = ["eval_split", "extract_main", "feature_encoder", "knn_main", "linear_main", "parse_tool_args", "run_tool",
           "train_crop"]

logger = logging.getLogger("sslkit")

#: The ``key=value`` arguments of each tool that are not config keys, with what they mean.
TOOL_KEYS: dict[str, dict[str, str]] = {
    "knn": {"checkpoint": "a run folder (its latest checkpoint) or a checkpoint file",
            "features": "trunk (default) | teacher | projector (a ViT's trunk and teacher: eval.vit_features)",
            "output": "where the results JSON goes (default <run>/eval/knn.json)"},
    "linear": {"checkpoint": "a run folder (its latest checkpoint) or a checkpoint file",
               "features": "trunk (default) | teacher (a ViT's: eval.vit_features)",
               "output": "where the results JSON goes (default <run>/eval/linear.json)"},
    "extract": {"checkpoint": "a run folder (its latest checkpoint) or a checkpoint file",
                "split": "train | test (default)",
                "features": "trunk (default) | teacher | projector (a ViT's trunk and teacher: eval.vit_features)",
                "normalize": "true: L2-normalise each feature vector (default false)",
                "output": "the file: .npz (features, labels, indices), .pt (the same as tensors) or .npy "
                          "(features; labels in <name>_labels.npy); default <run>/eval/features_<split>.npz"},
}


#: ``student=``, which every tool on a checkpoint takes.
STUDENT_KEY = ("a distillation run's student, by name (default: the first of distill.students): the trunk the tool "
               "reads")

#: The tools that keep their state after every epoch and resume from it.
RESUMABLE = ("linear", "finetune")


def parse_tool_args(tool: str, argv: list[str], keys: dict[str, str], prefixes: dict[str, str] | None = None,
                    groups: tuple[str, ...] = ()) -> tuple[dict[str, str], list[str]]:
    """Split ``key=value`` arguments into the tool's own (``keys``) and config overrides (the rest, applied to the
    run's config: ``eval.knn.k=20``, ``machine.device=cpu``). A key that is neither is an error naming the
    closest of both. ``prefixes`` shortens config sections (``{"bench.": "eval.bench."}``: ``bench.seed=1`` is
    ``eval.bench.seed=1``); ``groups`` are config groups passed on as they are (``data=folder``)."""
    opts: dict[str, str] = {}
    overrides: list[str] = []
    top_level = set(schema().keys()) | set(groups)
    keys = {**keys, "student": STUDENT_KEY} if "checkpoint" in keys else keys
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            example = "checkpoint=runs/simclr-fashion_mnist" if "checkpoint" in keys else f"{next(iter(keys))}=..."
            raise ToolError(f"'{arg}' is not of the form key=value (e.g. {example})")
        bare = key.lstrip("+~")
        short = next((p for p in prefixes or {} if bare.startswith(p)), None)
        if bare in keys:
            opts[bare] = value
        elif short is not None:
            overrides.append(arg.replace(short, (prefixes or {})[short], 1))
        elif "." in bare or bare in top_level:
            overrides.append(arg)
        else:
            raise ToolError(f"sslkit {tool}: unknown argument '{key}'.{did_you_mean(key, [*keys, *top_level])} "
                            f"It takes {', '.join(f'{k}=' for k in keys)} and config overrides (a.b=c).")
    probed = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in groups]
    if probed:  # a mistyped key is said before the checkpoint is read (values are checked with the run's config)
        from sslkit.config.compose import apply_overrides

        probe = schema()
        OmegaConf.set_struct(probe, False)
        apply_overrides(probe, probed)
    return opts, overrides


def run_tool(tool: str, body: Callable[[list[str]], int], argv: list[str] | None, usage: str) -> int:
    """Run a tool's ``body`` with the training command's error handling: a user error ends with a message on
    stderr and exit 2 (no traceback unless ``--debug``), Ctrl-C with 130, a full disk with 1."""
    args, debug = debug_flag(sys.argv[1:] if argv is None else list(argv))
    if any(a in ("-h", "--help") for a in args):
        print(usage)
        return 0
    setup_logging(None)
    try:
        return body(args)
    except KeyboardInterrupt:
        if debug:
            raise
        again = ": it resumes from its last finished epoch" if tool in RESUMABLE else ""
        print(f"sslkit {tool}: interrupted; run the same command again{again}.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (UserError, UnknownNameError) as exc:
        if debug:
            raise
        print(f"sslkit {tool}: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", EXIT_BAD_INPUT)
    except OSError as exc:
        if debug or exc.errno not in STORAGE_ERRNOS:
            raise
        print(f"sslkit {tool}: error: {storage_error(exc, 'to', str(exc.filename or '?'), known=False)}",
              file=sys.stderr)
        return EXIT_STOPPED


# ----------------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------------


def tool_pretrained(tool: str, opts: dict[str, str], overrides: list[str]) -> Pretrained:
    if "checkpoint" not in opts:
        raise ToolError(f"sslkit {tool} needs checkpoint=RUN_DIR (a run's output_dir: its latest checkpoint) or "
                        "checkpoint=FILE.pt")
    pre = load_pretrained(opts["checkpoint"], overrides)
    select_student(pre, opts.get("student"))
    logger.info("%s: checkpoint %s (step %d, %s, trunk %s) on %s", tool, pre.path, pre.step,
                pre.config.method.name, pre.config.model.trunk, pre.device)
    return pre


def tool_loader(cfg: DictConfig, source: Any, transform: DictConfig, device: torch.device, batch_size: int,
            train: bool = False) -> Any:
    from sslkit.builder import loader_for as build
    from sslkit.builder import resolve_num_workers

    workers, _ = resolve_num_workers(cfg.data.num_workers, device)
    pin = device.type == "cuda" if cfg.data.pin_memory == "auto" else bool(cfg.data.pin_memory)
    return build(cfg, source, transform, train=train, batch_size=batch_size, workers=workers, pin=pin)


def amp_dtype(cfg: DictConfig) -> torch.dtype | None:
    if not cfg.amp.enabled:
        return None
    return torch.bfloat16 if cfg.amp.dtype == "bfloat16" else torch.float16


def describe_data(cfg: DictConfig) -> dict[str, Any]:
    from sslkit.builder import eval_specs

    return {split: {"source": source, "path": path, "from": where}
            for split, (source, path, _, where) in eval_specs(cfg).items()}


def output_path(opts: dict[str, str], pre: Pretrained, default: str) -> str:
    path = opts.get("output") or os.path.join(pre.run_dir, "eval", default)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def write_json(path: str, record: dict[str, Any]) -> None:
    text = json.dumps(record, indent=1)
    atomic_write(path, lambda f: f.write(text.encode()))


def tool_sources(pre: Pretrained) -> tuple[Any, Any, int]:
    """The labelled sets of kNN and the linear probe for the trained model ``pre``, read with its trunk's channels
    where a set counts its own (``auto``)."""
    from sslkit.builder import eval_sources

    return eval_sources(pre.config, trunk_channels=pre.channels)


def eval_split(pre: Pretrained, split: str, advice: str = "") -> tuple[Any, str, str | None]:
    """The evaluation set ``split`` (train or test) of ``pre``'s config as :func:`~sslkit.builder.eval_specs` names
    it, cut to ``data.limit`` and read with the trunk's channels where it counts its own (``auto``): ``(dataset,
    source name, path)``. A folder or file-list source without its path is a :class:`ToolError` naming the key
    (``advice`` added)."""
    from sslkit.builder import eval_specs, limited
    from sslkit.builder.data import with_channels
    from sslkit.data import build_source

    cfg = pre.config
    source_name, path, kwargs, where = eval_specs(cfg)[split]
    if path is None and source_name in ("folder", "filelist"):
        raise ToolError(f"{where}.path is not set: a {source_name} source needs the path of its {split} set{advice}")
    kwargs = with_channels(source_name, kwargs, lambda: pre.channels)
    return limited(build_source(source_name, split, path, **kwargs), cfg.data.limit), str(source_name), path


def features_part(opts: dict[str, str], allowed: tuple[str, ...]) -> str:
    part = opts.get("features", "trunk")
    if part not in allowed:
        raise ToolError(f"features={part}: use one of {', '.join(allowed)}")
    return part


def part_module(pre: Pretrained, part: str) -> nn.Module:
    """The network ``features=`` names: the trunk, the teacher (momentum encoder) or the trunk and its head."""
    if part == "teacher":
        teacher = getattr(pre.model, "teacher_trunk", None)
        if teacher is None:
            raise ToolError(f"features=teacher: the {pre.config.method.name} model has no teacher (momentum encoder); "
                            "use features=trunk")
        return teacher
    return pre.encoder(part)


def feature_encoder(trunk: nn.Module, cfg: DictConfig) -> FeatureEncoder:
    """``trunk`` read as ``eval.vit_features`` / ``eval.vit_last_n`` say (:class:`FeatureEncoder`); a setting the
    trunk cannot give is a :class:`ToolError` naming the key."""
    try:
        return FeatureEncoder(trunk, str(cfg.eval.vit_features), int(cfg.eval.vit_last_n))
    except ValueError as exc:
        raise ToolError(f"eval.vit_features={cfg.eval.vit_features} eval.vit_last_n={cfg.eval.vit_last_n}: {exc}"
                        ) from None


def _encoder(pre: Pretrained, part: str) -> nn.Module:
    """What an evaluation encodes images with: the trunk or the teacher read through :func:`feature_encoder`, or the
    projector's output (the head reads the trunk's own features, so ``eval.vit_features`` does not apply)."""
    module = part_module(pre, part)
    if part == "projector":
        if pre.config.eval.vit_features != "pool":
            logger.info("features=projector: the head's output on the trunk's own features (eval.vit_features=%s "
                        "applies to the trunk and the teacher)", pre.config.eval.vit_features)
        return module
    return feature_encoder(module, pre.config)


def feature_record(encoder: nn.Module) -> dict[str, Any]:
    """What a results file says of the features read: ``vit_features`` and ``vit_last_n``."""
    if isinstance(encoder, FeatureEncoder):
        return encoder.describe()
    return {"vit_features": None, "vit_last_n": None}


def train_crop(cfg: DictConfig, crop_scale: Any) -> DictConfig:
    """The training transform of the linear probe (``augment=true``) and of fine-tuning: a random resized crop of
    area ``crop_scale`` at the eval transform's size and a flip, normalised as the eval transform (no colour
    augmentation)."""
    return OmegaConf.create({
        "name": "simclr", "image_size": int(cfg.data.eval_transform.get("image_size", cfg.data.image_size)),
        "num_views": 1, "crop_scale": list(crop_scale), "jitter_p": 0.0, "grayscale_p": 0.0, "blur_p": 0.0,
        "mean": cfg.data.eval_transform.get("mean"), "std": cfg.data.eval_transform.get("std")})


# ----------------------------------------------------------------------------------------------------
# kNN
# ----------------------------------------------------------------------------------------------------


def _knn(args: list[str]) -> int:
    opts, overrides = parse_tool_args("knn", args, TOOL_KEYS["knn"])
    pre = tool_pretrained("knn", opts, overrides)
    cfg = pre.config
    part = features_part(opts, ("trunk", "teacher", "projector"))
    train_source, test_source, num_classes = tool_sources(pre)
    k = cfg.eval.knn
    start = time.perf_counter()
    encoder = _encoder(pre, part)
    loaders = [tool_loader(cfg, s, cfg.data.eval_transform, pre.device, k.batch_size)
               for s in (train_source, test_source)]
    train_f, train_y = extract_features(encoder, loaders[0], pre.device, amp_dtype(cfg))
    test_f, test_y = extract_features(encoder, loaders[1], pre.device, amp_dtype(cfg))
    used_k = min(int(k.k), len(train_f))
    if used_k < k.k:
        logger.warning("kNN: eval.knn.k=%d but the train set has %d samples: using k=%d", k.k, len(train_f), used_k)
    found = weighted_knn(train_f, train_y, test_f, test_y, num_classes, used_k, float(k.temperature))
    record = {"top1": found["knn_top1"], "top5": found.get("knn_top5"), "step": pre.step, "checkpoint": pre.path,
              "features": part, **feature_record(encoder), "feature_dim": int(train_f.shape[1]),
              "num_train": len(train_f), "num_test": len(test_f), "num_classes": num_classes,
              "time_s": round(time.perf_counter() - start, 2),
              "config": {"k": used_k, "temperature": float(k.temperature), "protocol": "weighted kNN (Wu et al. "
                         "2018): cosine similarity, votes exp(s/T)", "data": describe_data(cfg),
                         "eval_transform": OmegaConf.to_container(cfg.data.eval_transform, resolve=True)}}
    path = output_path(opts, pre, "knn.json")
    write_json(path, record)
    top5 = f", top-5 {record['top5']:.4f}" if record["top5"] is not None else ""
    logger.info("kNN (k=%d, T=%g) of step %d: top-1 %.4f%s; written to %s", used_k, k.temperature, pre.step,
                record["top1"], top5, path)
    return 0


def knn_main(argv: list[str] | None = None) -> int:
    """``sslkit knn checkpoint=RUN_DIR [features=trunk] [eval.knn.k=20] [eval.data.train.path=...] ...``"""
    return run_tool("knn", _knn, argv, tool_usage("knn", "weighted kNN top-1/top-5 of a checkpoint's features, into "
                                               "<run>/eval/knn.json (eval.knn.k, eval.knn.temperature)"))


# ----------------------------------------------------------------------------------------------------
# Linear probe
# ----------------------------------------------------------------------------------------------------


def _linear(args: list[str]) -> int:
    from sslkit.checkpoint import Checkpointer

    opts, overrides = parse_tool_args("linear", args, TOOL_KEYS["linear"])
    pre = tool_pretrained("linear", opts, overrides)
    cfg = pre.config
    part = features_part(opts, ("trunk", "teacher"))
    lin = cfg.eval.linear
    s = settings_of(lin)
    train_source, test_source, num_classes = tool_sources(pre)
    encoder = _encoder(pre, part)
    device, amp = pre.device, amp_dtype(cfg)
    out = output_path(opts, pre, "linear.json")
    state_path = os.path.splitext(out)[0] + ".state.pt"
    eval_cfg = {"protocol": "SimCLR linear evaluation (Chen et al. 2020; google-research/simclr README, linear eval)",
                "epochs": s.epochs,
                "batch_size": s.batch_size, "lr": s.lr, "scaled_lr": s.scaled_lr, "momentum": s.momentum,
                "nesterov": s.nesterov, "weight_decay": s.weight_decay, "schedule": "cosine, no warmup",
                "classifier": "zero-initialised nn.Linear", "augment": bool(lin.augment),
                "crop_scale": list(lin.crop_scale) if lin.augment else None, "features": part,
                **feature_record(encoder), "data": describe_data(cfg), "seed": int(cfg.seed),
                "eval_transform": OmegaConf.to_container(cfg.data.eval_transform, resolve=True)}
    key = json.dumps({"step": pre.step, "checkpoint": os.path.abspath(pre.path), **eval_cfg}, sort_keys=True)

    fb = int(lin.batch_size_features)
    start = time.perf_counter()
    test_f, test_y = extract_features(encoder, tool_loader(cfg, test_source, cfg.data.eval_transform, device, fb),
                                      device, amp, normalize=False)
    test_f, test_y = test_f.to(device), test_y.to(device)
    dim = test_f.shape[1]
    head = make_classifier(dim, num_classes, device)
    optimizer = make_optimizer(head, s)
    records: list[dict[str, Any]] = []
    done_epochs, step = 0, 0
    if os.path.exists(state_path):
        saved = Checkpointer.read(state_path)
        if saved.get("key") == key:
            head.load_state_dict(saved["classifier"])
            optimizer.load_state_dict(saved["optimizer"])
            records, done_epochs, step = list(saved["records"]), int(saved["epoch"]), int(saved["step"])
            logger.info("linear: resuming from epoch %d of %d (%s)", done_epochs, s.epochs, state_path)
        else:
            logger.info("linear: %s is of another checkpoint or other settings; starting afresh", state_path)

    if not lin.augment:
        train_loader = tool_loader(cfg, train_source, cfg.data.eval_transform, device, fb)
        train_f, train_y = extract_features(encoder, train_loader, device, amp, normalize=False)
        train_f, train_y = train_f.to(device), train_y.to(device)
        steps_per_epoch = -(-train_f.shape[0] // s.batch_size)
        logger.info("linear: features computed once (eval.linear.augment=false): %d train x %d, %d test",
                    train_f.shape[0], dim, test_f.shape[0])
    else:
        train_loader = tool_loader(cfg, train_source, train_crop(cfg, lin.crop_scale), device, s.batch_size, train=True)
        steps_per_epoch = len(train_loader)
        logger.info("linear: random resized crop (scale %s) and flip each epoch, the trunk frozen in eval mode",
                    list(lin.crop_scale))
    total_steps = steps_per_epoch * s.epochs

    for epoch in range(done_epochs, s.epochs):
        def lr_at(t: int) -> float:
            return cosine_lr(s.scaled_lr, t, total_steps)

        if not lin.augment:
            g = torch.Generator().manual_seed(int(cfg.seed) * 100_003 + epoch)
            loss, step = train_epoch(head, optimizer, feature_batches(train_f, train_y, s.batch_size, g), lr_at, step)
        else:
            train_loader.sampler.set_epoch(epoch)
            loss, step = train_epoch(head, optimizer, _encoded(encoder, train_loader, device, amp), lr_at, step)
        acc = accuracy(head, test_f, test_y, num_classes)
        records.append({"epoch": epoch + 1, "train_loss": round(loss, 6), "lr": lr_at(step), **acc})
        logger.info("linear epoch %d/%d: train loss %.4f, test top-1 %.4f%s", epoch + 1, s.epochs, loss,
                    acc["top1"], f", top-5 {acc['top5']:.4f}" if "top5" in acc else "")
        state = {"key": key, "classifier": head.state_dict(), "optimizer": optimizer.state_dict(),
                 "records": records, "epoch": epoch + 1, "step": step}
        atomic_write(state_path, lambda f, st=state: torch.save(st, f))
        write_json(out, epochs_record(records, pre, s.epochs, eval_cfg, start, dim, num_classes, test_f.shape[0]))
    record = epochs_record(records, pre, s.epochs, eval_cfg, start, dim, num_classes, test_f.shape[0])
    write_json(out, record)
    logger.info("linear probe of step %d: top-1 %.4f%s after %s; written to %s", pre.step, record["top1"],
                f", top-5 {record['top5']:.4f}" if record.get("top5") is not None else "", plural(s.epochs, "epoch"),
                out)
    return 0


def epochs_record(records: list[dict[str, Any]], pre: Pretrained, epochs: int, eval_cfg: dict[str, Any],
                  start: float, dim: int, num_classes: int, num_test: int) -> dict[str, Any]:
    """The JSON of a trained evaluation (the linear probe, fine-tuning): the last epoch's top-1 / top-5, the best,
    whether all ``epochs`` are done, the checkpoint's step, the settings, and every epoch's record."""
    last = records[-1] if records else {}
    return {"top1": last.get("top1"), "top5": last.get("top5"),
            "best_top1": max((r["top1"] for r in records), default=None),
            "done": len(records) >= epochs, "epochs_done": len(records), "step": pre.step, "checkpoint": pre.path,
            "feature_dim": dim, "num_classes": num_classes, "num_test": num_test,
            "time_s_this_start": round(time.perf_counter() - start, 2), "config": eval_cfg, "epochs": records}


def _encoded(encoder: nn.Module, loader: Any, device: torch.device, amp: torch.dtype | None):
    """(frozen features, labels) of each batch of ``loader``: the encoder in eval mode, no gradient."""
    encoder.eval()
    for batch in loader:
        x = batch["input"][0].to(device, non_blocking=True)
        with torch.no_grad(), (torch.autocast(device.type, amp) if amp else contextlib.nullcontext()):
            f = encoder(x)
        yield f.reshape(f.shape[0], -1).float(), batch["target"].to(device, non_blocking=True)


def linear_main(argv: list[str] | None = None) -> int:
    """``sslkit linear checkpoint=RUN_DIR [eval.linear.epochs=30] [eval.linear.augment=false] ...``"""
    return run_tool("linear", _linear, argv, tool_usage("linear", "a linear classifier on the frozen trunk (SimCLR's "
                                                     "protocol), top-1/top-5 per epoch into <run>/eval/linear.json; "
                                                     "resumes from its last epoch (eval.linear.*)"))


# ----------------------------------------------------------------------------------------------------
# Feature extraction
# ----------------------------------------------------------------------------------------------------


def _extract(args: list[str]) -> int:
    opts, overrides = parse_tool_args("extract", args, TOOL_KEYS["extract"])
    if "checkpoint" not in opts:
        raise ToolError("sslkit extract needs checkpoint=RUN_DIR or checkpoint=FILE.pt")
    split = opts.get("split", "test")
    if split not in ("train", "test"):
        raise ToolError(f"split={split}: use split=train or split=test")
    output = opts.get("output")
    if output and os.path.splitext(output)[1] not in (".npz", ".npy", ".pt"):
        raise ToolError(f"output={output}: the file's extension says the format: .npz, .npy or .pt")
    from omegaconf import OmegaConf as _O

    nproc = int(_O.from_dotlist([o for o in overrides if o.startswith("distributed.nproc_per_node=")] or
                                ["distributed.nproc_per_node=1"]).distributed.nproc_per_node)
    if nproc > 1:
        from sslkit.tools.pretrained import pretrained_config

        # Checked here, once, before any process starts: the checkpoint, the keys, and one GPU per process.
        cfg = pretrained_config(opts["checkpoint"], overrides)
        d = cfg.distributed
        return launch_workers(_extract_worker, (args,), "sslkit extract", nproc_per_node=nproc, backend=d.backend,
                              timeout_s=d.timeout_s, device=cfg.machine.device)
    _extract_rank(opts, overrides, split)
    return 0


def _extract_worker(args: list[str]) -> None:
    """A spawned extraction process: its share of the samples, written by rank 0 in dataset order. A user's
    error (a bad checkpoint, a missing dataset) is said once, by rank 0, as ``sslkit extract`` says it."""
    from sslkit.distributed import get_rank

    setup_logging(None, get_rank())  # rank 0 speaks, the others only warn
    opts, overrides = parse_tool_args("extract", args, TOOL_KEYS["extract"])
    try:
        _extract_rank(opts, overrides, opts.get("split", "test"))
    except UserError as exc:
        end_worker(exc, "sslkit extract")


def _extract_rank(opts: dict[str, str], overrides: list[str], split: str) -> None:
    from sslkit.distributed import all_gather_object, get_rank, is_distributed

    pre = tool_pretrained("extract", opts, overrides)
    cfg = pre.config
    part = features_part(opts, ("trunk", "teacher", "projector"))
    normalize = opts.get("normalize", "false").lower() in ("1", "true", "yes")
    source, _, _ = eval_split(pre, split)
    loader = tool_loader(cfg, source, cfg.data.eval_transform, pre.device, int(cfg.eval.linear.batch_size_features))
    encoder = _encoder(pre, part)
    encoder.eval()
    feats: list[Tensor] = []
    labels: list[Tensor] = []
    indices: list[Tensor] = []
    amp = amp_dtype(cfg)
    with torch.no_grad():
        for batch in loader:
            x = batch["input"][0].to(pre.device, non_blocking=True)
            with torch.autocast(pre.device.type, amp) if amp else contextlib.nullcontext():
                f = encoder(x)
            f = f.reshape(f.shape[0], -1).float()
            if normalize:
                f = torch.nn.functional.normalize(f, dim=1)
            feats.append(f.cpu())
            labels.append(batch["target"].reshape(-1).long())
            indices.append(batch["data_idx"].reshape(-1).long())
    mine = (torch.cat(feats), torch.cat(labels), torch.cat(indices))
    if is_distributed():  # every rank's share, by index (the sampler pads the last ranks by repeating samples)
        shares = all_gather_object(mine)
        if get_rank() != 0:
            return
        features, targets, index = (torch.cat([s[i] for s in shares]) for i in range(3))
    else:
        features, targets, index = mine
    order = torch.argsort(index, stable=True)
    keep = torch.ones_like(order, dtype=torch.bool)
    keep[1:] = index[order][1:] != index[order][:-1]
    order = order[keep]
    features, targets, index = features[order], targets[order], index[order]
    out = output_path(opts, pre, f"features_{split}.npz")
    _save_features(out, features, targets, index, {"checkpoint": pre.path, "step": pre.step, "split": split,
                                                   "features": part, **feature_record(encoder),
                                                   "normalized": normalize})
    logger.info("extract: %d x %d %s features of the %s split (step %d) written to %s", features.shape[0],
                features.shape[1], part, split, pre.step, out)


def _save_features(path: str, features: Tensor, labels: Tensor, indices: Tensor, meta: dict[str, Any]) -> None:
    ext = os.path.splitext(path)[1]
    if ext == ".pt":
        atomic_write(path, lambda f: torch.save({"features": features, "labels": labels, "indices": indices,
                                                 "meta": json.dumps(meta)}, f))
    elif ext == ".npy":
        atomic_write(path, lambda f: np.save(f, features.numpy()))
        labels_path = os.path.splitext(path)[0] + "_labels.npy"
        atomic_write(labels_path, lambda f: np.save(f, labels.numpy()))
    else:
        atomic_write(path, lambda f: np.savez(f, features=features.numpy(), labels=labels.numpy(),
                                              indices=indices.numpy(), meta=np.array(json.dumps(meta))))


def extract_main(argv: list[str] | None = None) -> int:
    """``sslkit extract checkpoint=RUN_DIR split=test output=feats.npz [features=projector] ...``"""
    return run_tool("extract", _extract, argv, tool_usage("extract", "features and labels of a split to a file, in "
                                                       "dataset order (distributed.nproc_per_node=N: N processes)"))


def tool_usage(tool: str, what: str, keys_of: dict[str, str] | None = None) -> str:
    keys = "\n".join(f"  {k}=...  {v}" for k, v in (keys_of or TOOL_KEYS.get(tool, {})).items())
    return (f"usage: sslkit {tool} checkpoint=RUN_DIR|FILE [key=value ...]\n\n{what}.\n\n{keys}\n"
            "  a.b=c    any config key, applied to the run's config (e.g. machine.device=cpu, eval.data.train.path=..."
            ")\n\ndocs/evaluation.md has the protocols.")

