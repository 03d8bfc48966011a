"""Sharded sources at scale: start-up and images/s per loader worker against the per-core JPEG decode limit.

    python benchmarks/data_sources.py [--samples 1000000] [--size 64] [--workers 1,2] [--batches 40]
                                      [--batch-size 256] [--scratch DIR] [--quick] [--remote] [--latency-ms 50]

Writes a synthetic set of ``--samples`` small JPEGs (``--size`` px; 1000 distinct smooth images, encoded once at
quality 90 and cycled, so the set costs the time of writing it, not of encoding it) as tar shards of 256 MB
(``data=webdataset``) and as a Hugging Face dataset (``data=hf``, ``save_to_disk``), then measures, one thing at a
time in this process:

* the per-core decode limit: PIL's ``Image.open(...).convert("RGB")`` and ``torchvision.io.decode_jpeg`` of the
  set's JPEGs, and of 500 x 375 ones (ImageNet's typical size, that of the published per-core figures), one
  thread, images/s;
* the shards' index: built from the tar headers (the first start) and read back from its cache (every later
  one), seconds; the HF dataset's opening (memory-mapped), seconds;
* time to the first batch: ``build_train_data`` for ``config=simclr`` on the source (the index cached) until the
  first batch (``--batch-size``, 256) is out of the loader (its workers started, decoding and augmenting);
* images/s per loader worker: decode + SimCLR augmentation of two views in the workers (``data.augment_on=workers``),
  ``--batches`` batches after 3 of warm-up, for each number of ``--workers``, divided by the workers.

With ``--remote``, the shards served over HTTP from this process (tests/remote_servers.py: Python's HTTP server with
byte ranges, in a thread) are measured too: the time to index them remotely with and without the index files
beside them, and images/s per loader worker by ranged reads and with the whole shards fetched (``data.cache_gb``),
on localhost and with ``--latency-ms`` added to every request (a distant store); the whole shards read in
``data.order=shards`` (two at a time, the next two fetched ahead), the ranged reads in the random order.

Prints a table for docs/data.md with the machine. ``--quick`` (2000 samples, 4 batches of 64, half a second a decoder)
checks it runs: its figures are not for the docs.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _jpegs(size: int | tuple[int, int], distinct: int = 1000) -> list[bytes]:
    from PIL import Image

    out = []
    for i in range(distinct):
        rng = np.random.default_rng(i)
        low = torch.from_numpy(rng.random((1, 3, 4, 4), dtype=np.float32))
        hw = (size, size) if isinstance(size, int) else size
        img = torch.nn.functional.interpolate(low, size=hw, mode="bilinear")[0]
        noise = torch.from_numpy(rng.normal(0, 0.03, (3, *hw)).astype(np.float32))
        pixels = ((img + noise).clamp(0, 1).permute(1, 2, 0) * 255).to(torch.uint8).numpy()
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def decode_limits(jpegs: list[bytes], seconds: float = 5.0) -> dict[str, float]:
    """Images/s of one thread decoding ``jpegs`` with PIL and with torchvision.io.decode_jpeg."""
    import warnings

    from PIL import Image
    from torchvision.io import decode_jpeg

    warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tensors = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]
    rates = {}
    for name, fn in (("PIL", lambda k: np.asarray(Image.open(io.BytesIO(jpegs[k])).convert("RGB"))),
                     ("torchvision.io.decode_jpeg", lambda k: decode_jpeg(tensors[k]))):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fn(n % len(jpegs))
            n += 1
        rates[name] = n / (time.perf_counter() - start)
    torch.set_num_threads(threads)
    return rates


def write_sets(root: Path, samples: int, jpegs: list[bytes]) -> dict[str, float]:
    """The shards and the HF dataset of ``samples`` JPEGs; seconds each took."""
    from sslkit.data.shards import write_shards

    times = {}
    start = time.perf_counter()
    write_shards(((("jpg", jpegs[k % len(jpegs)], k % 10)) for k in range(samples)), root / "shards")
    for index in (root / "shards").glob("*.sslkit-idx.npz"):
        index.unlink()  # the first start builds them: timed below
    times["write shards"] = time.perf_counter() - start
    import datasets

    start = time.perf_counter()
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})

    def rows():
        for k in range(samples):
            yield {"image": {"bytes": jpegs[k % len(jpegs)], "path": None}, "label": k % 10}

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_generator(rows, features=features, cache_dir=str(root / "hf_cache"))
    ds.save_to_disk(str(root / "hf"))
    shutil.rmtree(root / "hf_cache", ignore_errors=True)
    times["write HF dataset"] = time.perf_counter() - start
    return times


def open_times(root: Path) -> dict[str, float]:
    """Seconds to open each source: the shards without their index cache (built), with it (read), the HF dataset."""
    from sslkit.data.hf import HFDataset
    from sslkit.data.shards import ShardDataset

    times = {}
    for label in ("shards, index built", "shards, index cached"):
        start = time.perf_counter()
        ShardDataset(str(root / "shards"))
        times[label] = time.perf_counter() - start
    start = time.perf_counter()
    HFDataset(root / "hf", "train", label_column="label")
    times["HF dataset, memory-mapped"] = time.perf_counter() - start
    return times


def _config(source: str, path: Path | str, size: int, workers: int, batches: int, batch: int, out: Path):
    from sslkit.config.compose import compose_config

    extra = ["data.train.kwargs.label_column=label"] if source == "hf" else []
    return compose_config(["config=simclr", f"data={source}", f"data.train.path={path}", *extra,
                           "machine.device=cpu", "data.augment_on=workers", f"data.num_workers={workers}",
                           f"data.batch_size={batch}", f"data.image_size={size}", f"data.small_image_size={size // 2}",
                           "model.trunk=small_cnn", f"optim.max_steps={batches + 3}", "eval.knn.enabled=false",
                           "log.tensorboard=false", f"output_dir={out}"])


def _cycle(loader):
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def loader_rates(root: Path, size: int, workers: list[int], batches: int, batch: int
                 ) -> list[tuple[str, int, float, float]]:
    """(source, workers, seconds to the first batch, images/s) through sslkit's training loader."""
    from sslkit.builder.data import build_train_data

    rows = []
    for source, path in (("webdataset", root / "shards"), ("hf", root / "hf")):
        for w in workers:
            cfg = _config(source, path, size, w, batches, batch, root / "run")
            start = time.perf_counter()
            data = build_train_data(cfg, torch.device("cpu"), 1)
            it = _cycle(data.loader)
            next(it)
            first = time.perf_counter() - start
            for _ in range(2):
                next(it)
            start, images = time.perf_counter(), 0
            for _ in range(batches):
                images += len(next(it)["data_idx"])
            rate = images / (time.perf_counter() - start)
            del it
            rows.append((source, w, first, rate))
            print(f"{source}, {w} worker(s): first batch after {first:.1f} s, {rate:,.0f} img/s", flush=True)
    return rows


def remote_rates(root: Path, size: int, workers: list[int], batches: int, batch: int,
                 latency_ms: float) -> list[tuple[str, float, str]]:
    """The shards over HTTP: (measure, value, unit) rows, one thing at a time."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from remote_servers import http_server

    from sslkit.builder.data import build_train_data
    from sslkit.data.shards import ShardDataset

    shards = sorted((root / "shards").glob("*.tar"))
    pattern = f"shard-{{000000..{len(shards) - 1:06d}}}.tar"
    rows: list[tuple[str, float, str]] = []
    with http_server(root / "shards") as (base, faults):
        for label, keep in (("remote shards: the index read from the files beside them", True),
                            ("remote shards: the index built from the tar headers over HTTP", False)):
            hidden = []
            if not keep:
                for index in (root / "shards").glob("*.sslkit-idx.npz"):
                    index.rename(index.with_suffix(".hidden"))
                    hidden.append(index)
            start = time.perf_counter()
            ShardDataset(f"{base}/{pattern}", cache_dir=str(root / f"cache-{keep}"))
            rows.append((label, time.perf_counter() - start, "s"))
            for index in hidden:
                index.with_suffix(".hidden").rename(index)
            print(f"{label}: {rows[-1][1]:.1f} s", flush=True)
        for latency in (0.0, latency_ms / 1000):
            faults.latency_s = latency
            for cache_gb in (0.0, 64.0):
                for w in workers:
                    cfg = _config("webdataset", f"'{base}/{pattern}'", size, w, batches, batch, root / "run")
                    cfg.data.cache_gb, cfg.data.cache_dir = cache_gb, str(root / f"cache-run-{latency}-{cache_gb}")
                    if cache_gb:  # whole shards are for reading shard by shard (two at a time, the next two ahead)
                        cfg.data.order, cfg.data.shard_span = "shards", 2
                    data = build_train_data(cfg, torch.device("cpu"), 1)
                    it = _cycle(data.loader)
                    for _ in range(3):
                        next(it)
                    start, images = time.perf_counter(), 0
                    for _ in range(batches):
                        images += len(next(it)["data_idx"])
                    rate = images / (time.perf_counter() - start) / w
                    del it
                    how = "whole shards fetched (data.cache_gb, data.order=shards)" if cache_gb else "ranged reads"
                    label = f"remote shards, {latency * 1000:.0f} ms a request, {how}, {w} worker(s), per worker"
                    rows.append((label, rate, "img/s"))
                    print(f"{label}: {rate:,.0f} img/s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--scratch", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--remote", action="store_true", help="also the shards served over HTTP (see above)")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="added to every request in the remote rows")
    parser.add_argument("--reuse", action="store_true", help="keep the sets already in --scratch (not timed again); "
                        "their shards' indexes are deleted, so the first open builds them")
    a = parser.parse_args(argv)
    if a.quick:
        a.samples, a.batches, a.batch_size = 2000, 4, 64
    root = Path(a.scratch or tempfile.mkdtemp(prefix="sslkit-data-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    cpu = platform.processor() or platform.machine()
    print(f"machine: {cpu}, {os.cpu_count()} cores, python {platform.python_version()}, torch {torch.__version__}; "
          f"{a.samples:,} JPEGs of {a.size} px in {root}, batches of {a.batch_size}", flush=True)
    jpegs = _jpegs(a.size)
    print(f"JPEG size: median {statistics.median(len(j) for j in jpegs):,.0f} bytes", flush=True)
    seconds = 0.5 if a.quick else 5.0
    limits = {f"{k}, {a.size} px": v for k, v in decode_limits(jpegs, seconds).items()}
    # the published per-core figures (540-860 img/s) are for ImageNet-sized photos: the same decoders on 500 x 375
    limits.update({f"{k}, 500 x 375 px": v for k, v in decode_limits(_jpegs((375, 500), 50), seconds).items()})
    print(f"decode limits: {limits}", flush=True)
    if a.reuse and (root / "shards").is_dir() and (root / "hf").is_dir():
        writes: dict[str, float] = {}
        for index in (root / "shards").glob("*.sslkit-idx.npz"):
            index.unlink()
    else:
        writes = write_sets(root, a.samples, jpegs)
    print(f"written: {writes}", flush=True)
    opens = open_times(root)
    print(f"opened: {opens}", flush=True)
    workers = [int(w) for w in a.workers.split(",")]
    rows = loader_rates(root, a.size, workers, a.batches, a.batch_size)
    remote = remote_rates(root, a.size, workers, a.batches, a.batch_size, a.latency_ms) if a.remote else []
    print()
    print("| measure | value |")
    print("| --- | ---: |")
    for name, rate in limits.items():
        print(f"| decode limit, one core: {name} | {rate:,.0f} img/s |")
    for name, seconds in {**writes, **opens}.items():
        print(f"| {name} | {seconds:,.1f} s |")
    for source, w, first, rate in rows:
        print(f"| {source}, {w} worker(s): time to the first batch (index cached) | {first:,.1f} s |")
        print(f"| {source}, {w} worker(s): decode + 2 SimCLR views, per worker | {rate / w:,.0f} img/s |")
    for name, value, unit in remote:
        print(f"| {name} | {value:,.1f} {unit} |" if unit == "s" else f"| {name} | {value:,.0f} {unit} |")
    if not a.scratch:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
