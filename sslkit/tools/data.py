"""``sslkit data pack`` (a folder or file list into tar shards with their index, on disk or uploaded to object
storage), ``sslkit data index`` (the index written beside shards that have none), ``sslkit data info`` (what a
source holds: samples, classes, image sizes of a sample of it, unreadable ones), ``sslkit data scenes`` (the
offline dense task, written as a segmentation folder), ``sslkit data wild`` (the proving ground:
:mod:`sslkit.tools.wild`) and ``sslkit data stats`` (each channel's mean and std)."""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from sslkit.data.remote import is_url
from sslkit.data.sources import UnreadableSampleError, build_source
from sslkit.tools.common import parse_tool_args, run_tool
from sslkit.tools.pretrained import ToolError
from sslkit.tools.wild import WILD_KEYS, WILD_USAGE, wild_main

__all__ = ["channel_stats", "data_main", "guess_source", "source_info"]

logger = logging.getLogger("sslkit")

PACK_KEYS = {"input": "a folder of images (an ImageFolder tree or a flat folder) or a file list (path[,label])",
             "output": "the folder the shards go to (shard-000000.tar, ... and each one's index), or a remote one "
                       "(s3://bucket/train/, gs://...; credentials from the environment or a profile): each shard is "
                       "uploaded as soon as it is written, then removed here",
             "shard_mb": "about how many MB of images a shard holds (default 256)"}
INFO_KEYS = {"path": "a folder of images, a file list, tar shards (a folder, a brace pattern, a list of .tar) or a "
                     "Hugging Face dataset (a save_to_disk folder, Parquet or Arrow files)",
             "source": "folder | filelist | webdataset | hf (default: guessed from path)",
             "sample": "how many samples, spread over the source, are decoded for the sizes (default 64)"}
SCENES_KEYS = {"output": "the folder the scenes go to, in ADE20K's layout (images/, annotations/, dataset.json)",
               "path": "the Fashion-MNIST files (default: the system copy)",
               "train": "training scenes (default 4000)", "test": "test scenes (default 1000)",
               "canvas": "the side in pixels, a multiple of 28 (default 56)",
               "garments": "fewest and most garments per scene, e.g. [2,4] (default)",
               "jitter": "pixels a garment moves from its cell (default 6)",
               "seed": "the scenes' seed (default 0)"}
INDEX_KEYS = {"path": "remote shards (a brace pattern, a prefix s3://bucket/train/, a glob) or local ones",
              "cache_dir": "where the indexes are cached here (default: $SSLKIT_CACHE, else ~/.cache/sslkit)"}
STATS_KEYS = {"path": "a folder of images (any channels, 8 or 16 bits: .npy, TIFF, PNG, ...), a file list, shards or "
                      "a Hugging Face dataset",
              "source": "folder | filelist | webdataset | hf (default: guessed from path)",
              "channels": "the images' channels (default auto: the first readable image's count; 3, 1 for grey, "
                          "4 or 13 for multi-channel files)",
              "sample": "how many images, spread over the source, are read (default 10000; 0: all)",
              "output": "the JSON file written (default: data_stats.json in the current folder); train with "
                        "data.stats=FILE"}
USAGE = f"""usage: sslkit data pack input=FOLDER_OR_LIST output=SHARD_FOLDER_OR_URL [shard_mb=256]
       sslkit data index path=SHARDS [cache_dir=...]
       sslkit data info path=SOURCE [source=...] [sample=64]
       sslkit data scenes output=FOLDER [train=4000] [test=1000] [canvas=56] [garments=[2,4]] [seed=0]
       sslkit data stats path=SOURCE [source=...] [channels=auto] [sample=10000] [output=data_stats.json]
       {WILD_USAGE}

pack: {'; '.join(f'{k}= {v}' for k, v in PACK_KEYS.items())}
index: each shard's index of members (its tar headers read once) written beside it, so that every later reader
  fetches one small file per shard; {'; '.join(f'{k}= {v}' for k, v in INDEX_KEYS.items())}
info: {'; '.join(f'{k}= {v}' for k, v in INFO_KEYS.items())}
scenes: Fashion-MNIST garments of several classes on a larger canvas, each pixel labelled with its garment's class
  or background (the dense probe's offline task, eval.dense.dataset=scenes); {'; '.join(f'{k}= {v}' for k, v in
                                                                                    SCENES_KEYS.items())}
wild: Fashion-MNIST in the wild, the proving ground (garments blended into photographs, MNIST-M's way, with
  distractors; boxes and class maps beside them; docs/data.md); {'; '.join(f'{k}= {v}' for k, v in WILD_KEYS.items())}
stats: each channel's mean and standard deviation of the pixels in 0..1 (16-bit images divided by 65535), for the
  transforms' normalisation (data.stats=FILE); {'; '.join(f'{k}= {v}' for k, v in STATS_KEYS.items())}
Train on the shards with: python tools/run.py config=simclr data=webdataset data.train.path=SHARD_FOLDER"""


def guess_source(path: str) -> str:
    """The source that reads ``path``: ``webdataset`` (a brace pattern, a ``.tar``, a folder of them, a list of
    them), ``wild`` (a folder ``sslkit data wild`` wrote), ``hf`` (a ``save_to_disk`` folder, ``.parquet`` /
    ``.arrow`` files), ``filelist`` (another file), ``folder`` (another folder)."""
    from sslkit.data.wild_files import is_wild

    p = Path(path).expanduser()
    if "{" in path or p.suffix == ".tar" or is_url(path):
        return "webdataset"
    if is_wild(p):
        return "wild"
    if p.is_dir():
        if any(p.glob("*.tar")):
            return "webdataset"
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists() or any(p.glob("*.parquet")) or \
                any(p.glob("*.arrow")):
            return "hf"
        return "folder"
    if p.suffix in (".parquet", ".arrow"):
        return "hf"
    if p.is_file() and any(ln.strip().endswith(".tar") for ln in p.read_text(errors="replace").splitlines()[:5]):
        return "webdataset"
    return "filelist"


def source_info(ds: Dataset, sample: int) -> dict[str, Any]:
    """Samples and classes of ``ds``, and the image sizes and unreadable samples among ``sample`` of them spread
    evenly over it."""
    n = len(ds)  # type: ignore[arg-type]
    picked = sorted({j * n // min(n, sample) for j in range(min(n, sample))}) if n else []
    sizes, bad = [], []
    for i in picked:
        try:
            image, _ = ds[i]
            sizes.append((int(image.shape[-2]), int(image.shape[-1])))
        except UnreadableSampleError as e:
            bad.append(str(e))
    info: dict[str, Any] = {"samples": n, "classes": int(getattr(ds, "num_classes", 0)), "decoded": len(sizes),
                            "unreadable": len(bad), "unreadable_examples": bad[:3]}
    if sizes:
        heights, widths = [h for h, _ in sizes], [w for _, w in sizes]
        info["height"] = [min(heights), statistics.median(heights), max(heights)]
        info["width"] = [min(widths), statistics.median(widths), max(widths)]
    return info


def _pack(args: list[str]) -> int:
    from sslkit.data.shards import pack_images

    opts, overrides = parse_tool_args("data pack", args, PACK_KEYS)
    if overrides or "input" not in opts or "output" not in opts:
        raise ToolError("sslkit data pack needs input=FOLDER_OR_LIST and output=SHARD_FOLDER (and takes shard_mb=)")
    source = guess_source(opts["input"])
    if source not in ("folder", "filelist"):
        raise ToolError(f"input={opts['input']}: pack reads a folder of images or a file list, and this is a "
                        f"{source} source already")
    ds = build_source(source, "train", opts["input"])
    try:
        shard_mb = float(opts.get("shard_mb", 256))
    except ValueError:
        raise ToolError(f"shard_mb={opts['shard_mb']}: give a number of megabytes") from None
    start = time.perf_counter()
    if is_url(opts["output"]):
        return _pack_remote(ds, opts["output"], shard_mb, start, opts["input"])
    output = Path(opts["output"]).expanduser()
    if output.exists() and any(output.glob("*.tar")):
        raise ToolError(f"output={output} holds shards already: give an empty or new folder")
    shards = pack_images(list(ds.samples), output, int(shard_mb * (1 << 20)))  # type: ignore[attr-defined]
    size = sum(s.stat().st_size for s in shards)
    print(f"packed {len(ds)} images ({getattr(ds, 'num_classes', 0)} classes) from {opts['input']} into "  # type: ignore[arg-type]
          f"{len(shards)} shard(s) in {output}, {size / 1e6:.1f} MB, with their index, in "
          f"{time.perf_counter() - start:.1f} s")
    print(f"train on them: python tools/run.py config=simclr data=webdataset data.train.path={output}")
    return 0


def _pack_remote(ds: Any, url: str, shard_mb: float, start: float, given: str) -> int:
    """Pack into a local staging folder and upload each shard with its index as soon as it is complete."""
    import shutil
    import tempfile

    from sslkit.data.remote import Remote, RemoteReadError, cache_root, url_protocol
    from sslkit.data.shards import pack_images, upload_shard

    remote = Remote(url_protocol(url))
    prefix = url.rstrip("/")
    try:
        if remote.glob(f"{prefix}/*.tar"):
            raise ToolError(f"output={url} holds shards already: give an empty or new prefix")
    except RemoteReadError:
        pass  # a prefix that does not exist yet
    cache_root().mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="pack-", dir=cache_root()))
    uploaded: list[str] = []
    try:
        pack_images(list(ds.samples), staging, int(shard_mb * (1 << 20)),  # type: ignore[attr-defined]
                    on_shard=lambda shard: uploaded.append(upload_shard(shard, prefix, remote)))
    except RemoteReadError as exc:
        raise ToolError(f"output={url}: {exc} ({len(uploaded)} shard(s) uploaded before it)") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"packed {len(ds)} images ({getattr(ds, 'num_classes', 0)} classes) from {given} into "
          f"{len(uploaded)} shard(s) at {prefix}/, with their index, in {time.perf_counter() - start:.1f} s")
    print(f"train on them: python tools/run.py config=simclr data=webdataset data.train.path={prefix}/")
    return 0


def _index(args: list[str]) -> int:
    from sslkit.data.remote import Remote, RemoteReadError, url_protocol
    from sslkit.data.shards import expand_shards, shard_index, write_remote_index

    opts, overrides = parse_tool_args("data index", args, INDEX_KEYS)
    if overrides or "path" not in opts:
        raise ToolError("sslkit data index needs path=SHARDS (and takes cache_dir=)")
    path = opts["path"]
    remote = Remote(url_protocol(path)) if is_url(path) else None
    start = time.perf_counter()
    shards = expand_shards(path, remote)
    if not shards:
        raise ToolError(f"path={path} names no shard")
    for shard in shards:
        if not is_url(shard):
            shard_index(Path(shard))  # built and written beside the shard, or found there up to date
            continue
        assert remote is not None
        try:
            logger.info("data: %s", write_remote_index(str(shard), remote, opts.get("cache_dir")))
        except RemoteReadError as exc:
            raise ToolError(f"{shard}: {exc}") from None
    print(f"indexed {len(shards)} shard(s) of {path}, each index beside its shard, in "
          f"{time.perf_counter() - start:.1f} s")
    return 0


def _info(args: list[str]) -> int:
    opts, overrides = parse_tool_args("data info", args, INFO_KEYS)
    if overrides or "path" not in opts:
        raise ToolError("sslkit data info needs path=SOURCE (and takes source=, sample=)")
    source = opts.get("source") or guess_source(opts["path"])
    ds = build_source(source, "train", opts["path"])
    info = source_info(ds, int(opts.get("sample", 64)))
    print(f"{opts['path']} ({source}): {info['samples']} samples, "
          f"{info['classes'] or 'no'} classes")
    if "height" in info:
        print(f"image sizes over {info['decoded']} decoded samples: height {info['height'][0]}-{info['height'][2]} "
              f"(median {info['height'][1]:g}), width {info['width'][0]}-{info['width'][2]} "
              f"(median {info['width'][1]:g})")
    print(f"unreadable among them: {info['unreadable']}" + "".join(f"\n  - {e}" for e in info["unreadable_examples"]))
    return 0


def _int_key(opts: dict[str, str], key: str, default: int) -> int:
    try:
        return int(opts.get(key, default))
    except ValueError:
        raise ToolError(f"{key}={opts[key]}: give a whole number") from None


def _scenes(args: list[str]) -> int:
    from tqdm import tqdm

    from sslkit.data.segmentation import FASHION_CLASSES, split_scenes, write_segmentation_folder

    opts, overrides = parse_tool_args("data scenes", args, SCENES_KEYS)
    if overrides or "output" not in opts:
        raise ToolError("sslkit data scenes needs output=FOLDER (and takes path=, train=, test=, canvas=, garments=, "
                        "jitter=, seed=)")
    output = Path(opts["output"]).expanduser()
    if (output / "images").exists():
        raise ToolError(f"output={output} holds images/ already: give an empty or new folder")
    counts = {"train": _int_key(opts, "train", 4000), "test": _int_key(opts, "test", 1000)}
    garments = [int(g) for g in opts.get("garments", "[2,4]").strip("[]").split(",")]
    params = {"canvas": _int_key(opts, "canvas", 56), "garments": garments, "jitter": _int_key(opts, "jitter", 6),
              "threshold": 0.1, "seed": _int_key(opts, "seed", 0)}
    start = time.perf_counter()
    sets = {}
    for split, n in counts.items():
        src = build_source("fashion_mnist", split, opts.get("path"))
        try:
            sets[split] = split_scenes(src.images, src.labels, split, n, params["canvas"], tuple(garments),
                                       params["jitter"], params["threshold"], params["seed"])
        except ValueError as exc:
            raise ToolError(f"scenes: {exc}") from None
    meta = {"num_classes": 11, "classes": ["background", *FASHION_CLASSES], "reduce_zero_label": True,
            "made_by": "sslkit data scenes " + " ".join(args), **counts, **params,
            "labels": "annotations hold class + 1 (1 background, 2-11 the garments), 0 for faint edge pixels "
                      "(ignored); read with reduce_zero_label (the default)"}
    for split, ds in sets.items():
        with tqdm(total=len(ds), desc=f"scenes: {split}", unit="img", disable=None, leave=False) as bar:
            write_segmentation_folder(ds, output, split, meta if split == "test" else None, bar.update)
    print(f"wrote {counts['train']} training and {counts['test']} test scenes ({params['canvas']} px, "
          f"{garments[0]}-{garments[-1]} garments each, 11 classes) to {output} in "
          f"{time.perf_counter() - start:.1f} s")
    print(f"probe a ViT on them: sslkit dense checkpoint=RUN eval.dense.dataset=folder eval.dense.path={output}")
    return 0


def channel_stats(ds: Dataset, sample: int) -> dict[str, Any]:
    """Each channel's mean and standard deviation over every pixel of ``sample`` images of ``ds`` spread evenly over
    it (0: all), in 0..1 (:func:`~sslkit.data.transforms.unit_float`), summed in float64; unreadable images are
    skipped and counted."""
    import torch

    from sslkit.data.transforms import unit_float

    n = len(ds)  # type: ignore[arg-type]
    k = n if sample <= 0 else min(n, sample)
    total = squares = None
    pixels, read, bad, dtypes = 0, 0, 0, set()
    for i in sorted({j * n // k for j in range(k)}) if k else []:
        try:
            image, _ = ds[i]
        except UnreadableSampleError:
            bad += 1
            continue
        dtypes.add(str(image.dtype).replace("torch.", ""))
        x = unit_float(image).to(torch.float64).flatten(1)
        total = x.sum(1) if total is None else total + x.sum(1)
        squares = x.square().sum(1) if squares is None else squares + x.square().sum(1)
        pixels += x.shape[1]
        read += 1
    if total is None or squares is None:
        raise ToolError(f"none of the {k} images tried could be read")
    mean = total / pixels
    std = (squares / pixels - mean.square()).clamp(min=0).sqrt()
    return {"mean": [round(float(v), 6) for v in mean], "std": [round(float(v), 6) for v in std],
            "channels": int(mean.numel()), "images": read, "unreadable": bad, "pixels_per_channel": pixels,
            "dtype": sorted(dtypes)}


def _stats(args: list[str]) -> int:
    import json

    from sslkit.files import atomic_write

    opts, overrides = parse_tool_args("data stats", args, STATS_KEYS)
    if overrides or "path" not in opts:
        raise ToolError("sslkit data stats needs path=SOURCE (and takes source=, channels=, sample=, output=)")
    source = opts.get("source") or guess_source(opts["path"])
    start = time.perf_counter()
    channels = opts.get("channels", "auto")
    ds = build_source(source, "train", opts["path"],
                      channels=channels if channels == "auto" else _int_key(opts, "channels", 3))
    found = channel_stats(ds, _int_key(opts, "sample", 10000))
    found.update({"source": source, "path": opts["path"], "made_by": "sslkit data stats " + " ".join(args)})
    output = Path(opts.get("output", "data_stats.json")).expanduser()
    text = json.dumps(found, indent=1)
    atomic_write(str(output), lambda f: f.write(text.encode()))
    print(f"{opts['path']} ({source}): {found['channels']} channel(s) of {', '.join(found['dtype'])} over "
          f"{found['images']} images ({found['unreadable']} unreadable) in {time.perf_counter() - start:.1f} s")
    print(f"mean {found['mean']}\nstd  {found['std']}\nwritten to {output}; train with data.stats={output}")
    return 0


def data_main(argv: list[str] | None = None) -> int:
    """``sslkit data pack|index|info|scenes|stats|wild ...``."""
    import sys

    args = sys.argv[1:] if argv is None else list(argv)
    bodies = {"pack": _pack, "index": _index, "info": _info, "scenes": _scenes, "stats": _stats,
              "wild": wild_main}
    if not args or args[0] not in bodies:
        print(USAGE)
        return 0 if args and args[0] in ("-h", "--help") else 2
    body = bodies[args[0]]
    return run_tool("data", body, args[1:], USAGE)  # (its messages: "sslkit data: error: ...")
