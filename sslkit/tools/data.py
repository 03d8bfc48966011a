"""``sslkit data pack`` (a folder or file list into tar shards with their index) and ``sslkit data info`` (what a
source holds: samples, classes, image sizes of a sample of it, unreadable ones)."""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from sslkit.data.sources import UnreadableSampleError, build_source
from sslkit.tools.common import parse_tool_args, run_tool
from sslkit.tools.pretrained import ToolError

__all__ = ["data_main", "guess_source", "source_info"]

logger = logging.getLogger("sslkit")

PACK_KEYS = {"input": "a folder of images (an ImageFolder tree or a flat folder) or a file list (path[,label])",
             "output": "the folder the shards go to (shard-000000.tar, ... and each one's index)",
             "shard_mb": "about how many MB of images a shard holds (default 256)"}
INFO_KEYS = {"path": "a folder of images, a file list, tar shards (a folder, a brace pattern, a list of .tar) or a "
                     "Hugging Face dataset (a save_to_disk folder, Parquet or Arrow files)",
             "source": "folder | filelist | webdataset | hf (default: guessed from path)",
             "sample": "how many samples, spread over the source, are decoded for the sizes (default 64)"}
USAGE = f"""usage: sslkit data pack input=FOLDER_OR_LIST output=SHARD_FOLDER [shard_mb=256]
       sslkit data info path=SOURCE [source=...] [sample=64]

pack: {'; '.join(f'{k}= {v}' for k, v in PACK_KEYS.items())}
info: {'; '.join(f'{k}= {v}' for k, v in INFO_KEYS.items())}
Train on the shards with: python tools/run.py config=simclr data=webdataset data.train.path=SHARD_FOLDER"""


def guess_source(path: str) -> str:
    """The source that reads ``path``: ``webdataset`` (a brace pattern, a ``.tar``, a folder of them, a list of
    them), ``hf`` (a ``save_to_disk`` folder, ``.parquet`` / ``.arrow`` files), ``filelist`` (another file),
    ``folder`` (another folder)."""
    p = Path(path).expanduser()
    if "{" in path or p.suffix == ".tar":
        return "webdataset"
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


def data_main(argv: list[str] | None = None) -> int:
    """``sslkit data pack|info ...``."""
    import sys

    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] not in ("pack", "info"):
        print(USAGE)
        return 0 if args and args[0] in ("-h", "--help") else 2
    body = _pack if args[0] == "pack" else _info
    return run_tool("data", body, args[1:], USAGE)  # (its messages: "sslkit data: error: ...")
