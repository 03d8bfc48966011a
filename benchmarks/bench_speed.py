"""What sslkit bench's two heavy parts cost against the plain PyTorch they stand for, in this process:

    python benchmarks/bench_speed.py [--device cpu] [--images 2048] [--rounds 3] [--trunk small_cnn|vit_small]

1. **Extraction** (``sslkit.tools.bench.cache.extract_arrays``: the loader with the eval transform, the forward under
   ``no_grad``, a ViT's four feature choices read by hooks, the copy to the host) against the raw forward of the same
   model on the same images already in memory (``model(x)`` under ``no_grad`` in a loop of batches). Prints img/s of
   both and their ratio: 1.0 is "extraction runs at the model's forward speed".
2. **The grid of linear probes** (``train_probe_grid``: every (lr, weight decay) classifier of a feature choice
   trained together, one batched product and one update per step) against the same probes one after another, each an
   ``nn.Linear`` with ``torch.optim.SGD`` on the same batches and schedule: DINOv2's 13 learning rates x 2 weight
   decays on cached features of Fashion-MNIST's size. Prints both times and the speed-up.

Machine, torch version and threads are printed first; run it alone (a second heavy process on a 2-core machine
changes every figure)."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from sslkit import registry as R
from sslkit.evaluation.linear import cosine_lr
from sslkit.evaluation.probes import GridSettings, train_probe_grid
from sslkit.tools.bench.cache import BenchImages, extract_arrays, extraction_workers, summary


def _machine(device: torch.device) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU"
    return (f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {gpu}, torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads")


def _trunk(name: str) -> torch.nn.Module:
    import sslkit.models  # noqa: F401  (registrations)

    if name == "small_cnn":
        return R.get(R.TRUNKS, "small_cnn")(in_channels=1)
    return R.get(R.TRUNKS, name)(in_channels=1, img_size=28, patch_size=4)


def extraction(device: torch.device, images: int, rounds: int, trunk_name: str) -> tuple[float, float]:
    """(extraction img/s, raw forward img/s), medians over ``rounds``."""
    torch.manual_seed(0)
    model = _trunk(trunk_name).to(device).eval()
    data = torch.randint(0, 256, (images, 1, 28, 28), dtype=torch.uint8)
    source = TensorDataset(data, torch.zeros(images, dtype=torch.long))
    transform = {"image_size": 28, "mean": [0.5], "std": [0.5], "resize": None, "crop_pct": None, "channels": 1}
    bench_set = BenchImages(_Pairs(source), transform)
    x_all = torch.stack([bench_set[i][0] for i in range(images)]).to(device)
    ours, raw = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        extract_arrays(model, bench_set, device, 256, extraction_workers(bench_set, 1), summary(model, 4))
        _sync(device)
        ours.append(images / (time.perf_counter() - t))
        t = time.perf_counter()
        with torch.no_grad():
            for start in range(0, images, 256):
                out = model(x_all[start : start + 256])
                out.cpu()
        _sync(device)
        raw.append(images / (time.perf_counter() - t))
    return statistics.median(ours), statistics.median(raw)


class _Pairs(torch.utils.data.Dataset):
    """A TensorDataset as sslkit's in-memory sources (Fashion-MNIST, CIFAR) give items, (uint8 image, int label),
    with their ``images`` and ``labels`` tensors."""

    def __init__(self, ds: TensorDataset) -> None:
        self.ds = ds
        self.images, self.labels = ds.tensors

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = self.ds[i]
        return x.clone(), int(y)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probes(device: torch.device, n: int, dim: int, epochs: int) -> tuple[float, float, int]:
    """(seconds of the grid trained together, seconds of the same probes one after another, probes)."""
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(n, dim, generator=g).to(device)
    labels = torch.randint(0, 10, (n,), generator=g).to(device)
    s = GridSettings(epochs=epochs, batch_size=256)
    t = time.perf_counter()
    train_probe_grid({"pool": feats}, labels, 10, s)
    _sync(device)
    together = time.perf_counter() - t
    t = time.perf_counter()
    cells = [(lr, wd) for lr in s.lrs for wd in s.weight_decays]
    total = epochs * -(-n // 256)
    for lr, wd in cells:
        head = torch.nn.Linear(dim, 10).to(device)
        opt = torch.optim.SGD(head.parameters(), lr=s.scaled(lr), momentum=0.9, weight_decay=wd)
        step = 0
        for epoch in range(epochs):
            order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).to(device)
            for start in range(0, n, 256):
                idx = order[start : start + 256]
                for group in opt.param_groups:
                    group["lr"] = s.scaled(lr) * cosine_lr(1.0, step, total)
                opt.zero_grad()
                F.cross_entropy(head(feats[idx]), labels[idx]).backward()
                opt.step()
                step += 1
    _sync(device)
    return together, time.perf_counter() - t, len(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trunk", default="small_cnn")
    parser.add_argument("--probe-samples", type=int, default=54000)
    parser.add_argument("--probe-dim", type=int, default=384)
    parser.add_argument("--probe-epochs", type=int, default=2)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(_machine(device))
    ours, raw = extraction(device, args.images, args.rounds, args.trunk)
    print(f"extraction ({args.trunk}, {args.images} images of 28 px, batch 256): {ours:.0f} img/s; raw forward "
          f"{raw:.0f} img/s; ratio {ours / raw:.2f}")
    together, apart, count = probes(device, args.probe_samples, args.probe_dim, args.probe_epochs)
    print(f"linear probes ({count} of them, {args.probe_samples} x {args.probe_dim} features, {args.probe_epochs} "
          f"epochs): together {together:.1f} s; one after another {apart:.1f} s; speed-up {apart / together:.1f}x")


if __name__ == "__main__":
    main()
