"""What a checkpoint costs for a ResNet-50 SimCLR task: sslkit's atomic save and load against plain torch.save/load.

    python benchmarks/checkpoint_time.py [--rounds 5] [--dir /path/on/the/disk/to/measure] [key=value ...]

Builds the SimCLR recipe with a ResNet-50 trunk (2048-d features, the 2048-512-128 head of the
recipe's defaults unless overridden), takes one optimizer step so that SGD's momentum buffers
exist, then, alternating for ``--rounds`` rounds in this process:

* sslkit: ``CheckpointHook.save`` = ``Checkpointer.state(task)`` + write to a temporary file + fsync +
  rename + the ``latest.txt`` pointer (also fsynced) + keep-last pruning;
* plain: ``torch.save(Checkpointer.state(task), path)`` (no fsync, no rename: what a loop without
  crash safety does);
* load: ``Checkpointer.read_latest`` against plain ``torch.load``.

Prints the checkpoint size and the median of each, and the ratios. The fsync makes the sslkit
save wait for the disk, which a plain save leaves to the page cache: the ratio is the price of
"a crash never leaves a torn checkpoint".
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from sslkit.builder import build_task
from sslkit.checkpoint import Checkpointer
from sslkit.config.compose import compose_config
from sslkit.console import setup_logging
from sslkit.hooks.checkpoint import CheckpointHook
from sslkit.train_steps.standard import standard_train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        cfg = compose_config([
            "config=simclr", "data=synthetic", "data.train.kwargs.num_samples=32", "data.batch_size=8",
            "data.num_workers=0", "model.trunk=resnet50", "model.trunk_kwargs={small_image_stem: true}",
            "model.head.hidden_dim=2048", "eval.knn.enabled=false", "log.tensorboard=false",
            f"output_dir={tmp}/run", *args.overrides,
        ])
        setup_logging(None)
        task = build_task(cfg)
        task.start_phase()
        standard_train_step(task)  # fills the optimizer state (momentum buffers)
        saver = next(h for h in task.hooks if isinstance(h, CheckpointHook))
        params = sum(p.numel() for p in task.base_model.parameters())
        print(f"model: {params / 1e6:.1f} M parameters (trunk {cfg.model.trunk}, head {cfg.model.head.hidden_dim}-d)")

        plain_path = os.path.join(tmp, "plain.pt")
        times: dict[str, list[float]] = {"sslkit save": [], "plain save": [], "sslkit load": [], "plain load": []}
        for r in range(args.rounds):
            t0 = time.perf_counter()
            task.clock.step = r + 1  # a new file name each round, as in a run
            path = saver.save(task, "benchmark")
            t1 = time.perf_counter()
            torch.save(Checkpointer.state(task), plain_path)
            t2 = time.perf_counter()
            saver.checkpointer.read_latest()
            t3 = time.perf_counter()
            torch.load(plain_path, weights_only=False)
            t4 = time.perf_counter()
            for name, secs in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[name].append(secs)
            print(f"round {r}: " + ", ".join(f"{n} {v[-1] * 1000:.0f} ms" for n, v in times.items()))
        size = os.path.getsize(path) / 2**20
        med = {n: statistics.median(v) for n, v in times.items()}
        print(f"checkpoint size: {size:.1f} MiB ({path})")
        print(f"median save: sslkit {med['sslkit save'] * 1000:.0f} ms, plain torch.save "
              f"{med['plain save'] * 1000:.0f} ms, ratio {med['sslkit save'] / med['plain save']:.2f} "
              f"({size / med['sslkit save']:.0f} MiB/s)")
        print(f"median load: sslkit {med['sslkit load'] * 1000:.0f} ms, plain torch.load "
              f"{med['plain load'] * 1000:.0f} ms, ratio {med['sslkit load'] / med['plain load']:.2f}")


if __name__ == "__main__":
    main()
