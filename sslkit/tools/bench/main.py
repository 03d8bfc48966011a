"""``sslkit bench``: several backbones on one dataset, every chosen protocol, one results folder; and ``sslkit bench
compare``."""

from __future__ import annotations

import copy
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.utils.data import Subset
from tqdm import tqdm

from sslkit.data.dataset import sample_file
from sslkit.data.segmentation import SegmentationTransform, TransformedSegmentation
from sslkit.data.sources import cache_dir, dataset_labels
from sslkit.errors import UserError, did_you_mean
from sslkit.tools.bench.backbones import Backbone, BenchError, load_backbones, parse_list
from sslkit.tools.bench.cache import (
    BenchImages,
    FeatureCache,
    data_fingerprint,
    extract_arrays,
    extraction_workers,
    module_heads,
    module_patch,
    patch_tokens,
    protocol_capable,
    summary,
    token_capable,
    token_maps,
)
from sslkit.tools.bench.protocols import PROTOCOLS as RUNNERS
from sslkit.tools.bench.protocols import Features, LinearChoice, fit_linear, linear_epochs, linear_hits
from sslkit.tools.bench.report import compare_folders, comparisons, write_results
from sslkit.tools.common import parse_tool_args, run_tool
from sslkit.tools.dense import dense_image_size, dense_window

__all__ = ["BENCH_KEYS", "PROTOCOLS", "bench_finished_run", "bench_main"]

logger = logging.getLogger("sslkit")

#: The protocols, in table order.
PROTOCOLS = ("knn", "linear", "fewshot", "retrieval", "attentive", "dense", "robustness")
#: The protocols that read patch tokens: a ViT's (or the pixels' patches), never a CNN's.
TOKEN_PROTOCOLS = ("attentive", "dense")
#: The command's own keys (the rest are config keys; ``bench.X`` is short for ``eval.bench.X``).
BENCH_KEYS = {
    "backbones": "[RUN, RUN:teacher, RUN:STUDENT, ARCH@WEIGHTS, timm:NAME@WEIGHTS, pixels, random]",
    "protocols": f"[{', '.join(PROTOCOLS)}] (default: every one that fits)",
    "output": "the results folder (default bench/<data preset>)",
}
USAGE = f"""usage: sslkit bench backbones=[...] [data=PRESET] [protocols=[...]] [output=DIR] [--dry-run] [key=value ...]
       sslkit bench compare DIR DIR ... [output=FILE.md]

Every backbone on every protocol over one dataset, one table: results.json, .md, .csv, .png in output=.

  backbones=  {BENCH_KEYS['backbones']}
              RUN: an sslkit run folder or checkpoint (its trunk; :teacher its EMA teacher; :NAME a distillation
              student); ARCH@WEIGHTS: an sslkit ViT trunk with a Meta or timm weights file; timm:NAME@WEIGHTS: any
              timm model with its own weights file; pixels: the raw pixels; random: each architecture at random init
  protocols=  {BENCH_KEYS['protocols']}
  output=     {BENCH_KEYS['output']}
  data=       a data preset (fashion_mnist, cifar10, folder, hf, webdataset, ...) and its data.* keys
  bench.X=    eval.bench.X (cache_dir, seed, knn.ks, linear.lrs, fewshot.shots, ...: sslkit/config/defaults.yaml)
  --dry-run   list what would run and what the cache holds, extract nothing

docs/evaluation.md, "Comparing backbones", has the protocols and what the figures mean."""


def _split_args(args: list[str]) -> tuple[dict[str, str], list[str], bool]:
    """The command's keys, the config overrides (``bench.`` made ``eval.bench.``) and ``--dry-run``."""
    rest = [a for a in _rejoin(args) if a != "--dry-run"]
    opts, overrides = parse_tool_args("bench", rest, BENCH_KEYS, {"bench.": "eval.bench."}, ("data", "config"))
    return opts, overrides, "--dry-run" in args


def _rejoin(args: list[str]) -> list[str]:
    """A list the shell split at its spaces (``backbones=[a,`` ``b]``) joined back into one argument."""
    out: list[str] = []
    for arg in args:
        if out and out[-1].count("[") > out[-1].count("]"):
            out[-1] += " " + arg
        else:
            out.append(arg)
    return out


def _settings(cfg: DictConfig, opts: dict[str, str]) -> tuple[list[str], list[str], bool, dict[str, Any]]:
    """The backbones' specs, the protocols (in table order), whether they were asked for by name (else: every
    protocol, each where it fits), and the settings (``eval.bench`` with ``eval.dense`` as ``dense``)."""
    b = cfg.eval.bench
    specs = parse_list(opts["backbones"]) if "backbones" in opts else [str(x) for x in b.backbones]
    if not specs:
        raise BenchError("no backbones: give backbones=[RUN, ARCH@WEIGHTS, timm:NAME@WEIGHTS, pixels, random]")
    asked = parse_list(opts["protocols"]) if "protocols" in opts else [str(x) for x in b.protocols]
    for p in asked:
        if p not in PROTOCOLS:
            raise BenchError(f"protocols: unknown protocol '{p}'.{did_you_mean(p, list(PROTOCOLS))} The protocols "
                             f"are {', '.join(PROTOCOLS)}")
    protocols = [p for p in PROTOCOLS if p in asked] if asked else list(PROTOCOLS)
    settings = OmegaConf.to_container(b, resolve=True)
    assert isinstance(settings, dict)
    settings.pop("backbones", None)
    settings["dense"] = OmegaConf.to_container(cfg.eval.dense, resolve=True)
    return specs, protocols, bool(asked), settings


def _data(cfg: DictConfig, protocols: list[str]) -> tuple[Any, Any, int, dict[str, Any]]:
    """The labelled train and test sets, their classes and what identifies them: the data's own splits, or, with
    ``eval.bench.test_fraction``, a stratified seeded part of its train split as the test split (the rest as train).
    A dataset without labels is a :class:`BenchError` naming it and the protocols that need them."""
    from sslkit.builder import eval_sources, eval_specs
    from sslkit.builder.data import open_source
    from sslkit.data.sources import DataSourceError

    specs = eval_specs(cfg)
    where = f"{specs['train'][0]}{', ' + str(specs['train'][1]) if specs['train'][1] else ''}"
    fraction = cfg.eval.bench.test_fraction
    try:
        if fraction:
            source, path, kwargs, _ = specs["train"]
            whole = open_source(cfg, source, "train", path, kwargs)
            classes = int(getattr(whole, "num_classes", 0))
            if classes <= 0:
                raise DataSourceError("it has no labels")
            train, test = _seeded_split(whole, float(fraction), int(cfg.eval.bench.seed))
            specs = {**specs, "test": specs["train"]}
        else:
            train, test, classes = eval_sources(cfg)
    except DataSourceError as exc:
        raise BenchError(f"data ({where}): {exc}. The protocols {', '.join(protocols)} need labelled train and test "
                         "sets") from None
    described: dict[str, Any] = {"num_classes": classes, "limit": int(cfg.data.limit),
                                 "classes": [int(c) for c in cfg.data.classes] or "all",
                                 "test_split": (f"a stratified {float(fraction):g} of the train split, seed "
                                                f"{int(cfg.eval.bench.seed)}") if fraction else "the data's own"}
    for split, ds in (("train", train), ("test", test)):
        source, path, kwargs, _ = specs[split]
        described[split] = {"source": source, "path": path, "kwargs": kwargs, "size": len(ds),
                            "fingerprint": data_fingerprint(ds, path, {"source": source, "kwargs": kwargs,
                                                                       "split": split})}
    return train, test, classes, described


def _seeded_split(ds: Any, fraction: float, seed: int) -> tuple[Subset, Subset]:
    """``(train, test)`` subsets of ``ds``: ``fraction`` of each class, drawn by ``seed``, as the test part
    (:func:`~sslkit.evaluation.probes.stratified_split`). The labels are read without decoding where the source
    lists them (``labels``, ``targets``, ``samples``), else image by image."""
    from sslkit.evaluation.probes import stratified_split

    if not 0.0 < fraction < 1.0:
        raise BenchError(f"eval.bench.test_fraction={fraction}: give a fraction in (0, 1)")
    labels = dataset_labels(ds)
    rest, test = stratified_split(labels, fraction, seed)
    return Subset(ds, rest.tolist()), Subset(ds, test.tolist())


def _entries(bench: Bench, b: Backbone) -> dict[str, dict[str, Any]]:
    """The cache entries a backbone needs: ``train``, ``test``; for robustness ``test/<kind>/<severity>``; for the
    attentive probe ``tokens/train`` and ``tokens/test``; for dense ``dense/train`` and ``dense/test``; each the
    parts its key is made of."""
    settings, data = bench.settings, bench.data
    base = {"weights": b.weights_id, "arch": b.arch, "kind": b.kind, "transform": b.transform,
            "part": {k: v for k, v in b.details.items() if k in ("part", "student")},
            "last_n": int(settings["vit_last_n"]), "torch": torch.__version__, "device": bench.device.type}
    entries = {split: {**base, "split": split, "data": data[split]["fingerprint"], "corruption": None}
               for split in ("train", "test")}
    patch = bench.patch if b.module is None else None
    if "attentive" in bench.protocols and protocol_capable(b.module, "attentive"):
        for split in ("train", "test"):
            entries[f"tokens/{split}"] = {**entries[split], "tokens": "patches", "patch": patch}
    if "dense" in bench.protocols and protocol_capable(b.module, "dense") and bench.seg is not None:
        for split in ("train", "test"):
            window = None if not token_capable(b.module) or b.module is None else dense_window(  # a CNN: no windows
                settings["dense"]["window"], int(b.transform["image_size"]), bench.seg["size"])
            entries[f"dense/{split}"] = {**base, "split": split, "data": bench.seg["fingerprint"][split],
                                         "corruption": None, "dense_size": bench.seg["size"], "patch": patch,
                                         "window": window}
    if "robustness" in bench.protocols:
        from sslkit.evaluation.corruptions import table_for

        r = settings["robustness"]
        table = table_for(str(r["table"]), int(b.transform["image_size"]))
        for kind in r["corruptions"]:
            for sev in r["severities"]:
                entries[f"test/{kind}/{sev}"] = {**entries["test"], "corruption": [kind, int(sev), table],
                                                 "seed": int(settings["seed"])}
    return entries


def _source(bench: Bench, b: Backbone, name: str, parts: dict[str, Any]
            ) -> tuple[Any, Callable[[torch.Tensor], dict[str, torch.Tensor]], str, tuple[str, ...]]:
    """What entry ``name`` is extracted from and how: the dataset, the per-batch summary, the name of the items'
    second element (labels or class maps) and the arrays kept as float16."""
    group, _, rest = name.partition("/")
    if group == "dense":
        t = b.transform
        assert bench.seg is not None
        transform = SegmentationTransform(bench.seg["size"], t.get("mean"), t.get("std"), channels=t.get("channels"))
        window = parts["window"]
        return (TransformedSegmentation(bench.seg["sets"][rest], transform),
                lambda x: {"maps": token_maps(b.module, x, bench.patch, window)}, "masks", ("maps",))
    split = rest if group == "tokens" else group
    corruption = tuple(parts["corruption"]) if parts["corruption"] else None
    images = BenchImages(bench.sets[split], b.transform, corruption, int(bench.settings["seed"]))  # type: ignore[arg-type]
    if group == "tokens":
        return images, lambda x: {"tokens": patch_tokens(b.module, x, bench.patch)}, "labels", ("tokens",)
    return images, summary(b.module, int(bench.settings["vit_last_n"])), "labels", ()


def _features(bench: Bench, b: Backbone, name: str, parts: dict[str, Any]) -> tuple[Features, bool]:
    """An entry from the cache (True), or extracted (with a progress bar) and stored first (False). Over several
    processes each
    extracts every world-th image, rank 0 puts the shares together in dataset order and stores them; a failure on
    any rank fails the entry on all of them (no rank is left waiting)."""
    from sslkit.distributed import all_gather_object, barrier

    cache = bench.cache
    key = cache.key(parts)
    world, rank = bench.world, bench.rank
    arrays = cache.load(key)
    if world > 1 and bool(all_gather_object(arrays is not None)[0]):  # rank 0's view of the cache decides for all
        arrays = arrays or cache.load(key)
    if arrays is not None:
        return Features(arrays), True
    images, summarize, target, half = _source(bench, b, name, parts)
    total = len(images)
    if world > 1:
        images = Subset(images, range(rank, total, world))
    error, mine = None, None
    try:
        with tqdm(total=len(images), desc=f"{b.name}: {name}", unit="img", disable=None, leave=False) as bar:
            mine = extract_arrays(b.module, images, bench.device, int(bench.settings["batch_size"]),
                                  extraction_workers(images, bench.workers),
                                  summarize, target, bar.update, half)
    except Exception as exc:  # (a failure of this backbone, reported in its row)
        if world == 1:
            raise
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    if world > 1:
        shares = all_gather_object((mine, error))
        errors = [e for _, e in shares if e]
        if errors:
            raise RuntimeError(errors[0])
        mine = {k: _interleave([sh[k] for sh, _ in shares], total) for k in shares[0][0]}
    assert mine is not None
    if rank == 0:
        cache.store(key, mine, {"backbone": b.name, "entry": name,
                                **{k: v for k, v in parts.items() if k != "data"}, "data": parts["data"][:16]})
    if world > 1:
        barrier()
    return Features(cache.load(key) or mine), False


def _names(entries: list[str]) -> str:
    """Cache entries in few words: train, test and the corrupted test sets counted (``test/noise/3``)."""
    plain = [n for n in entries if "/" not in n or n.startswith(("dense/", "tokens/"))]
    corrupted = len(entries) - len(plain)
    return ", ".join(plain + ([f"{corrupted} corrupted test set(s)"] if corrupted else []))


def _interleave(shares: list[np.ndarray], total: int) -> np.ndarray:
    """Rank r's rows are images r, r + world, ...: back in dataset order."""
    out = np.empty((total, *shares[0].shape[1:]), dtype=shares[0].dtype)
    for r, share in enumerate(shares):
        out[r::len(shares)] = share
    return out


def _run_backbone(bench: Bench, b: Backbone) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Every protocol on one backbone: ``(its record, its per-image values)``; None on a rank other than 0 of several
    processes, which only helps extract. A patch-token protocol on a backbone without patch tokens (by default, a
    CNN) is recorded as not measured."""
    start = time.perf_counter()
    entries = _entries(bench, b)
    found = {n: _features(bench, b, n, parts) for n, parts in entries.items()}
    feats = {n: f for n, (f, _) in found.items()}
    if bench.rank != 0:
        return None
    cached = [n for n, (_, hit) in found.items() if hit]
    logger.info("bench: %s: features of %s from the cache%s (%.1f s)", b.name, _names(cached) or "none",
                f", of {_names([n for n in found if n not in cached])} extracted" if len(cached) < len(found) else "",
                time.perf_counter() - start)
    record: dict[str, Any] = {"metrics": {}, "details": {}, "time_s": {"features": round(time.perf_counter() - start,
                                                                                            2)},
                              "cache": {n: bench.cache.key(p) for n, p in entries.items()}}
    per_image: dict[str, Any] = {}
    chosen: list[Any] = []
    for protocol in bench.protocols:
        t0 = time.perf_counter()
        if protocol in TOKEN_PROTOCOLS and not protocol_capable(b.module, protocol):
            record["details"][protocol] = {"not_measured": f"{b.arch} gives no patch tokens"
                                           f"{'' if protocol == 'attentive' else ' and no feature map'}"}
            continue
        outcome = _protocol(bench, b, protocol, feats, per_image, chosen)
        record["metrics"].update(outcome.metrics)
        record["details"][protocol] = outcome.details
        per_image.update(outcome.per_image)
        record["time_s"][protocol] = round(time.perf_counter() - t0, 2)
    record["unreadable"] = {"train": feats["train"].unreadable, "test": feats["test"].unreadable}
    record["backbone"] = {"kind": b.kind, "arch": b.arch, "weights_sha256": b.weights_id, "transform": b.transform,
                          **b.details}
    return record, per_image


def _protocol(bench: Bench, b: Backbone, protocol: str, feats: dict[str, Features], found: dict[str, Any],
              chosen: list[Any]) -> Any:
    """One protocol's :class:`~sslkit.tools.bench.protocols.Outcome` for backbone ``b``; ``found``: the per-image
    values of the protocols before it; ``chosen``: the linear grid's choice, fitted once for linear and
    robustness."""
    train, test = feats["train"], feats["test"]
    s, classes, device = bench.settings, bench.classes, bench.device
    if protocol in ("linear", "robustness") and not chosen:
        chosen.append(fit_linear(train, classes, s, device, _grid_bar(b, s, train)))
    if protocol == "linear":
        return RUNNERS["linear"](train, test, classes, s, device, chosen[0])
    if protocol == "robustness":
        corrupted = {n.split("/", 1)[1]: f for n, f in feats.items() if n.startswith("test/")}
        clean = _clean(found, train, test, classes, s, device, chosen[0][0])
        return RUNNERS["robustness"](train, corrupted, clean, classes, s, device, chosen[0][0])
    if protocol == "attentive":
        a = s["attentive"]
        fit = int(len(train.labels) * (1 - float(a["val_fraction"])))
        fit = min(fit, int(a["train_samples"]) or fit)
        bar = _steps_bar(f"{b.name}: attentive probe", -(-fit // int(a["batch_size"])) * int(a["epochs"]))
        return RUNNERS["attentive"](feats["tokens/train"], feats["tokens/test"], classes, s, device,
                                    module_heads(b.module), bar)
    if protocol == "dense":
        assert bench.seg is not None
        d, maps = s["dense"], feats["dense/train"].arrays
        bar = _steps_bar(f"{b.name}: dense head", -(-int(maps["maps"].shape[0]) // int(d["batch_size"])) *
                         int(d["epochs"]))
        return RUNNERS["dense"](maps, feats["dense/test"].arrays, bench.seg["classes"], s, device, bar)
    return RUNNERS[protocol](train, test, classes, s, device)


def _clean(found: dict[str, torch.Tensor], train: Features, test: Features, classes: int, s: dict[str, Any],
           device: torch.device, chosen: LinearChoice) -> dict[str, torch.Tensor]:
    """The clean test hits robustness is relative to: kNN at ``robustness.k`` and the chosen classifier's, those
    the knn and linear protocols ``found`` when they ran (with that k), else computed."""
    k = int(s["robustness"]["k"])
    if f"knn_k{k}" not in found:
        found = {**found, **RUNNERS["knn"](train, test, classes, {**s, "knn": {**s["knn"], "ks": [k]}},
                                           device).per_image}
    linear = found["linear"] if "linear" in found else linear_hits(chosen, test, device)
    return {"knn": found[f"knn_k{k}"], "linear": linear}


def _grid_bar(b: Backbone, settings: dict[str, Any], train: Features) -> Callable[[int], None]:
    n = int(len(train.labels) * (1 - float(settings["linear"]["val_fraction"])))
    steps = -(-n // int(settings["linear"]["batch_size"])) * linear_epochs(n, settings)
    return _steps_bar(f"{b.name}: linear grid", steps)


def _steps_bar(desc: str, steps: int) -> Callable[[int], None]:
    """A progress bar of ``steps`` steps that closes itself at the last."""
    bar = tqdm(total=steps, desc=desc, unit="step", disable=None, leave=False)

    def update(k: int) -> None:
        bar.update(k)
        if bar.n >= steps:
            bar.close()
    return update


def _name_unreadable(data: dict[str, Any], found: dict[str, list[int]], sets: dict[str, Any]) -> None:
    """``data[split]["unreadable"]``: the images left out, by path below the split's folder where it has files."""
    for split, indices in found.items():
        root = data[split].get("path")
        names = [sample_file(sets[split], i) for i in indices]
        data[split]["unreadable"] = [os.path.relpath(n, root) if n and root else (n or str(i))
                                     for n, i in zip(names, indices)]


def _dry_run(bench: Bench) -> int:
    data, cache = bench.data, bench.cache
    print(f"sslkit bench --dry-run: {len(bench.backbones)} backbone(s) x {', '.join(bench.protocols)} on "
          f"{data['name']} ({data['train']['size']} train, {data['test']['size']} test, {data['num_classes']} classes)"
          f"; results would go to {bench.output}; cache {cache.root}")
    for b in bench.backbones:
        entries = _entries(bench, b)
        held = [n for n, p in entries.items() if cache.load(cache.key(p)) is not None]
        todo = [n for n in entries if n not in held]
        print(f"  {b.name} ({b.kind}, {b.arch}): cached {len(held)} of {len(entries)} feature sets"
              f"{'; would extract ' + ', '.join(todo) if todo else ''}")
    print(f"  the cache holds {len(cache.entries())} feature set(s)")
    return 0


@dataclass
class Bench:
    """A bench ready to run: what it compares, on which data, with which settings, and where things go."""

    settings: dict[str, Any]
    protocols: list[str]
    backbones: list[Backbone]
    #: the labelled ``train`` and ``test`` sets
    sets: dict[str, Any]
    classes: int
    #: what the results say of the data (sources, sizes, fingerprints)
    data: dict[str, Any]
    cache: FeatureCache
    device: torch.device
    workers: int
    output: str
    command: str
    #: the dense protocol's sets (``sets``, ``classes``, ``size``, ``described``, ``fingerprint``), or None
    seg: dict[str, Any] | None
    #: the patch the pixels' tokens are cut in
    patch: int
    #: processes (``distributed.nproc_per_node``) and how to start them (backend, timeout, device)
    nproc: int
    launch: dict[str, Any]
    #: this process's place among the bench's processes
    rank: int = 0
    world: int = 1


def _prepare(args: list[str]) -> tuple[Bench, bool]:
    """Everything checked and read before anything is extracted: the keys, the protocols, the data and its labels,
    every backbone. Raises :class:`BenchError` (exit 2) naming what is wrong."""
    from sslkit.config.compose import compose_config

    opts, overrides, dry = _split_args(args)
    # the bench trains nothing on data.train's batches: drop_last=false keeps the training-size check quiet
    cfg = compose_config(["data.drop_last=false", *overrides])
    data_name = next((o.split("=", 1)[1] for o in overrides if o.startswith("data=")), "fashion_mnist")
    return _ready(cfg, opts, data_name, "sslkit bench " + " ".join(args)), dry


def _ready(cfg: DictConfig, opts: dict[str, str], data_name: str, command: str, alone: bool = False) -> Bench:
    """:class:`Bench` of a composed config and the command's own keys (``backbones``, ``protocols``, ``output``);
    ``alone``: one process, whatever process group this one belongs to (a training run's rank 0)."""
    from sslkit.builder import resolve_device, resolve_num_workers
    from sslkit.distributed import get_rank, get_world_size, is_distributed

    specs, protocols, named, settings = _settings(cfg, opts)
    if len(set(specs)) < len(specs):
        raise BenchError(f"backbones: {', '.join(sorted({s for s in specs if specs.count(s) > 1}))} listed twice")
    output = opts.get("output") or settings.get("output") or os.path.join("bench", data_name)
    try:
        device = resolve_device(str(cfg.machine.device))
    except RuntimeError as exc:
        raise BenchError(str(exc)) from None
    train, test, classes, data = _data(cfg, protocols)
    data["name"] = data_name
    backbones, failures = load_backbones(specs, cfg, str(device))
    if failures:
        listed = "\n  ".join(f"{spec}: {why}" for spec, why in failures.items())
        raise BenchError(f"{len(failures)} backbone(s) cannot be read, nothing was extracted:\n  {listed}")
    patch = _token_checks(backbones, protocols, named, int(cfg.data.patch_size))
    seg = _dense_data(cfg, data_name, protocols, named, backbones)
    if seg is None and "dense" in protocols:
        protocols = [p for p in protocols if p != "dense"]
    if "robustness" in protocols and not _corruptible(test, named):
        protocols = [p for p in protocols if p != "robustness"]
    cache = FeatureCache(str(settings["cache_dir"] or os.path.join(cache_dir(), "features")))
    workers, _ = resolve_num_workers(settings["num_workers"], device)
    return Bench(settings, protocols, backbones, {"train": train, "test": test}, classes, data, cache, device, workers,
                 output, command, seg, patch, int(cfg.distributed.nproc_per_node),
                 {"backend": str(cfg.distributed.backend), "timeout_s": float(cfg.distributed.timeout_s),
                  "device": str(cfg.machine.device)},
                 *((0, 1) if alone or not is_distributed() else (get_rank(), get_world_size())))


def _corruptible(test: Any, named: bool) -> bool:
    """Whether the robustness protocol's corruptions (ImageNet-C's, on 8-bit images of 1 or 3 channels) fit the
    test images, judged on the first readable one. Asked for by name on images that do not fit: a
    :class:`BenchError` saying what does; by default, the protocol is left out (logged)."""
    from sslkit.data.sources import UnreadableSampleError

    for i in range(min(len(test), 32)):
        try:
            image = test[i][0]
        except UnreadableSampleError:
            continue
        if image.dtype == torch.uint8 and image.dim() == 3 and image.shape[0] in (1, 3):
            return True
        what = f"{str(image.dtype).replace('torch.', '')} images of {image.shape[0]} channel(s)"
        if named:
            raise BenchError(f"protocols=robustness applies ImageNet-C's corruptions to 8-bit images of 1 or 3 "
                             f"channels, and the test images are {what}: leave robustness out of protocols")
        logger.info("bench: robustness left out: its corruptions take 8-bit images of 1 or 3 channels, the data "
                    "has %s", what)
        return False
    return True


def _token_checks(backbones: list[Backbone], protocols: list[str], named: bool, default_patch: int) -> int:
    """The patch the pixels' tokens are cut in (the first ViT's, else ``data.patch_size``). A patch-token protocol
    asked for by name on a backbone without patch tokens (a CNN) is a :class:`BenchError` naming both; asked for
    by default, such a backbone's cell stays empty."""
    wanted = [p for p in protocols if p in TOKEN_PROTOCOLS]
    if named and wanted:
        for protocol in wanted:
            cannot = [b.name for b in backbones if not protocol_capable(b.module, protocol)]
            if cannot:
                what = "a ViT's patch tokens" if protocol == "attentive" else "patch tokens or a CNN's feature map"
                raise BenchError(f"protocols={protocol} reads {what}, and {', '.join(cannot)} give(s) none: leave "
                                 "the protocol out, or bench that backbone with the other protocols")
    for b in backbones:
        if token_capable(b.module) and b.module is not None:
            return module_patch(b.module, default_patch)
    return default_patch


def _dense_data(cfg: DictConfig, data_name: str, protocols: list[str], named: bool, backbones: list[Backbone]
                ) -> dict[str, Any] | None:
    """The dense protocol's segmentation sets (``eval.dense``: the Fashion-MNIST scenes, or a folder), read and
    checked before anything is extracted; None when dense is not run: not asked for, or, by default, scenes beside
    data other than Fashion-MNIST. A folder without class maps of its images' sizes, or a side that is not a
    multiple of a ViT's patch: a :class:`BenchError` naming the dataset and the protocol."""
    from sslkit.tools.dense import segmentation_sets

    if "dense" not in protocols or (not named and cfg.eval.dense.dataset not in ("folder", "wild") and
                                    data_name != "fashion_mnist"):
        return None
    try:
        train, test, classes, described = segmentation_sets(cfg)
    except UserError as exc:
        raise BenchError(f"protocols=dense: {exc}") from None
    size = dense_image_size(cfg)
    for b in backbones:
        if b.module is None or not token_capable(b.module):
            continue
        patch = module_patch(b.module, 1)
        window = dense_window(cfg.eval.dense.window, int(b.transform["image_size"]), size)
        for what, side in (("the segmentation images are resized to", size), ("its window is", window)):
            if side and side % patch:
                raise BenchError(f"protocols=dense: {what} {side} px (eval.dense.image_size, eval.dense.window), not "
                                 f"a multiple of {b.name}'s {patch} px patches")
    path = str(described["path"]) if described["dataset"] in ("folder", "wild") else None
    sets = {"train": train, "test": test}
    return {"sets": sets, "classes": classes, "size": size, "described": described,
            "fingerprint": {split: data_fingerprint(ds, path, {**described, "split": split, "size": len(ds)})
                            for split, ds in sets.items()}}


def bench_finished_run(cfg: DictConfig, output_dir: str) -> str:
    """The bench a training run ends with (``eval.bench.at_end``: its protocols), in this process, on the run's own
    data and evaluation sets: the run's latest checkpoint beside ``eval.bench.backbones`` (``[pixels, random]``
    say), into ``<output_dir>/bench/``. Returns the table's path."""
    extra = [str(b) for b in cfg.eval.bench.backbones if str(b) != output_dir]
    opts = {"backbones": "[" + ",".join([output_dir, *extra]) + "]",
            "protocols": "[" + ",".join(str(p) for p in cfg.eval.bench.at_end) + "]",
            "output": os.path.join(output_dir, "bench")}
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.distributed.nproc_per_node = 1
    bench = _ready(cfg, opts, str(cfg.name), f"eval.bench.at_end of {output_dir}", alone=True)
    _measure(bench)
    return os.path.join(bench.output, "results.md")


def _measure(bench: Bench) -> int:
    """Every backbone on every protocol; rank 0 writes the results folder. Exit 1 when a backbone failed."""
    start = time.perf_counter()
    results: dict[str, Any] = {}
    per_image: dict[str, Any] = {}
    for b in bench.backbones:
        logger.info("bench: %s (%s, %s)", b.name, b.kind, b.arch)
        try:
            found = _run_backbone(bench, b)
        except Exception as exc:  # one backbone's failure is its row; the others are measured
            logger.error("bench: %s failed: %s: %s (the other backbones go on)", b.name, type(exc).__name__, exc)
            results[b.name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        finally:
            if b.module is not None:
                b.module.cpu()
        if found is not None:
            results[b.name], per_image[b.name] = found
    if bench.rank != 0:
        return 0
    ok = {n: r for n, r in results.items() if "error" not in r}
    _name_unreadable(bench.data, next(iter(ok.values()), {}).get("unreadable", {}), bench.sets)
    record = {"data": bench.data, "settings": bench.settings, "protocols": bench.protocols,
              "backbones": [b.name for b in bench.backbones], "results": results,
              "comparisons": comparisons(ok, per_image, bench.settings), "device": str(bench.device),
              "processes": bench.nproc, "time_s": round(time.perf_counter() - start, 2),
              "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "command": bench.command}
    paths = write_results(bench.output, record)
    logger.info("bench: %d backbone(s) x %d protocol(s) in %.0f s; %s", len(bench.backbones), len(bench.protocols),
                record["time_s"], paths["md"])
    with open(paths["md"], encoding="utf-8") as f:
        print(f.read())
    return 1 if len(ok) < len(results) else 0


def _bench(args: list[str]) -> int:
    if args and args[0] == "compare":
        return _compare(args[1:])
    bench, dry = _prepare(args)
    if dry:
        return _dry_run(bench)
    if bench.nproc > 1:
        from sslkit.console import launch_workers

        return launch_workers(_bench_worker, (args,), "sslkit bench", nproc_per_node=bench.nproc, **bench.launch)
    return _measure(bench)


def _bench_worker(args: list[str]) -> None:
    """A spawned bench process: its share of every extraction; rank 0 also runs the protocols and writes. A user's
    error is said once, by rank 0."""
    from sslkit.console import end_worker, setup_logging
    from sslkit.distributed import get_rank

    setup_logging(None, get_rank())
    try:
        bench, _ = _prepare(args)
        code = _measure(bench)
    except UserError as exc:
        end_worker(exc, "sslkit bench")
    if code:
        sys.exit(code)


def _compare(args: list[str]) -> int:
    folders = [a for a in args if "=" not in a]
    out = next((a.split("=", 1)[1] for a in args if a.startswith("output=")), None)
    if not folders:
        raise BenchError("sslkit bench compare needs results folders: sslkit bench compare DIR DIR ...")
    for f in folders:
        path = os.path.join(f, "results.json") if os.path.isdir(f) else f
        if not os.path.isfile(path):
            raise BenchError(f"compare: {f} holds no results.json (a folder sslkit bench wrote)")
    text = compare_folders(folders)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    print(text, end="")
    return 0


def bench_main(argv: list[str] | None = None) -> int:
    """``sslkit bench backbones=[...] data=PRESET protocols=[...] output=DIR`` and ``sslkit bench compare DIR ...``."""
    args = sys.argv[1:] if argv is None else list(argv)
    return run_tool("bench", _bench, args, USAGE)
