"""``sslkit data wild``: write the proving ground, Fashion-MNIST in the wild (:mod:`sslkit.data.wild`), to a folder
or tar shards, every option checked before anything is written."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sslkit.tools.common import parse_tool_args
from sslkit.tools.pretrained import ToolError

__all__ = ["WILD_KEYS", "WILD_USAGE", "wild_main"]

def _shown(value: Any) -> str:
    return f"[{','.join(str(v) for v in value)}]" if isinstance(value, tuple) else str(value)


def _keys() -> dict[str, str]:
    """The command's options, each knob's default read from :class:`~sslkit.data.wild.WildSpec` (its one home)."""
    from sslkit.data.wild import WildSpec
    from sslkit.data.wild_files import DEFAULT_COUNTS

    d = {k: _shown(tuple(v)) if isinstance(v, list) else v for k, v in WildSpec().describe().items()}
    return {
        "output": "the folder written (new or empty): images, annotations/ and dataset.json",
        "train": f"training images (default {DEFAULT_COUNTS['train']}: each Fashion-MNIST training garment once)",
        "test": f"test images (default {DEFAULT_COUNTS['test']})",
        "canvas": f"the images' side in pixels (default {d['canvas']}; 64-128 with a larger scale=)",
        "seed": "the images' seed (default 0)",
        "photos": "a folder of photographs (default: Debian's mate-backgrounds nature set; dead_leaves: drawn ones, "
                  "also used when the default is not installed)",
        "licence": "the photographs' licence, recorded in dataset.json (default: the mate set's GPL-2+)",
        "format": "folder (an ImageFolder tree per split, the default) or shards (tar shards per split)",
        "workers": "processes rendering and writing (default 1)",
        "scale": f"the garments' 28 px frame times [low,high] (default {d['scale']})",
        "rotation": f"most degrees a garment turns either way (default {d['rotation']})",
        "saturation": f"the tint's HSV saturation range (default {d['saturation']})",
        "value": f"the tint's HSV value range (default {d['value']})",
        "distractors": f"fewest and most distractor garments (default {d['distractors']})",
        "reach": f"how far a distractor's centre lies from an edge, in its side (default {d['reach']})",
        "zooms": f"the photographs' shorter side in canvases (default {d['zooms']})",
        "blend": f"difference (MNIST-M's |photo - garment|) or over (default {d['blend']})",
    }


WILD_KEYS = _keys()
WILD_USAGE = ("sslkit data wild output=DIR [train=N] [test=N] [canvas=32] [seed=0] [photos=DIR] "
              "[format=folder|shards] [workers=1] [scale=[low,high]] [rotation=...] [distractors=[a,b]] [blend=...]")

_INTS = ("train", "test", "canvas", "seed", "workers")
_FLOATS = ("rotation", "reach")
_PAIRS = {"scale": float, "saturation": float, "value": float, "distractors": int}


def _number(key: str, text: str, kind: type) -> Any:
    try:
        value = kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise ToolError(f"{key}={text}: give {what}") from None
    return value


def _list(key: str, text: str, kind: type, length: int | None) -> list[Any]:
    parts = [p.strip() for p in text.strip().strip("[]").split(",") if p.strip()]
    if (length is not None and len(parts) != length) or not parts:
        raise ToolError(f"{key}={text}: give [low,high], e.g. {key}=[{'1,2' if kind is int else '0.5,1.0'}]"
                        if length == 2 else f"{key}={text}: give a list, e.g. {key}=[2,4,8]")
    return [_number(key, p, kind) for p in parts]


def parse_wild_args(opts: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The command's options as (run options, the spec's knobs), each checked for its type."""
    run: dict[str, Any] = {k: _number(k, opts[k], int) for k in _INTS if k in opts}
    knobs: dict[str, Any] = {k: _number(k, opts[k], float) for k in _FLOATS if k in opts}
    knobs.update({k: _list(k, opts[k], kind, 2) for k, kind in _PAIRS.items() if k in opts})
    if "zooms" in opts:
        knobs["zooms"] = _list("zooms", opts["zooms"], int, None)
    if "canvas" in run:
        knobs["canvas"] = run.pop("canvas")
    if "blend" in opts:
        knobs["blend"] = opts["blend"]
    for key in ("train", "test"):
        if run.get(key, 1) < 1:
            raise ToolError(f"{key}={run[key]}: give a number of images, 1 or more")
    if run.get("workers", 1) < 1:
        raise ToolError(f"workers={run['workers']}: give 1 or more processes")
    fmt = opts.get("format", "folder")
    if fmt not in ("folder", "shards"):
        raise ToolError(f"format={fmt}: give folder (an ImageFolder tree per split) or shards (tar shards)")
    run["format"] = fmt
    return run, knobs


def wild_main(args: list[str]) -> int:
    """``sslkit data wild output=DIR ...``: check every option, read the photographs and Fashion-MNIST, then write
    the set (nothing is written when any of it fails)."""
    from tqdm import tqdm

    from sslkit.data.photos import PhotoError, load_photos
    from sslkit.data.sources import DataSourceError, build_source
    from sslkit.data.wild import WildSpec, WildSpecError
    from sslkit.data.wild_files import DEFAULT_COUNTS, write_wild

    opts, overrides = parse_tool_args("data wild", args, WILD_KEYS)
    if overrides or "output" not in opts:
        raise ToolError(f"sslkit data wild needs output=DIR; {WILD_USAGE}")
    output = Path(opts["output"]).expanduser()
    if output.is_file() or (output.is_dir() and any(output.iterdir())):
        raise ToolError(f"output={output} is a file or a folder with files in it: give a new or empty folder")
    run, knobs = parse_wild_args(opts)
    try:
        spec = WildSpec(**knobs)
        photos = load_photos(opts.get("photos"), spec.canvas, spec.zooms, opts.get("licence"))
        for split in ("train", "test"):
            build_source("fashion_mnist", split)  # found before anything is written
    except (WildSpecError, PhotoError, DataSourceError) as exc:
        raise ToolError(str(exc)) from None
    counts = {split: int(run.get(split, n)) for split, n in DEFAULT_COUNTS.items()}
    start = time.perf_counter()
    with tqdm(total=sum(counts.values()), desc="wild", unit="img", disable=None, leave=False) as bar:
        meta = write_wild(output, spec, int(run.get("seed", 0)), counts, photos, fmt=run["format"],
                          workers=int(run.get("workers", 1)), progress=bar.update,
                          made_by="sslkit data wild " + " ".join(args))
    took = time.perf_counter() - start
    print(f"wrote {counts['train']} training and {counts['test']} test images ({spec.canvas} px, version "
          f"{meta['version']}, seed {meta['seed']}, photographs: {photos.origin}) to {output} in {took:.1f} s "
          f"({sum(counts.values()) / took:.0f} images/s)")
    print(f"train on it: python tools/run.py config=simclr data=wild data.train.path={output}")
    return 0
