"""The bench's linear probe against a converged scikit-learn logistic regression on the same features: does the grid
(``sslkit bench``'s ``linear`` protocol, its default settings) reach what a converged classifier reaches?

    sslkit extract checkpoint=RUN split=train output=train.npz
    sslkit extract checkpoint=RUN split=test output=test.npz
    python benchmarks/linear_probe_check.py --train train.npz --test test.npz [--images 2000] [--cs 0.01 0.1 1 10]

Both are fitted on the same part of the first ``--images`` train images (a seeded draw; all of them by default)
less the bench's stratified validation part, on features standardised by that part's mean and std, and choose
their setting on the validation part: the grid its lr (:func:`~sslkit.tools.bench.protocols.fit_linear`),
scikit-learn its ``C`` among ``--cs`` (``LogisticRegression(C)``, L-BFGS, ``--max-iter``). Prints each one's test
top-1, the difference, each ``C``'s validation and test accuracy, and the seconds each took. ``--quick``: random
features, to check that it runs. Needs scikit-learn (``pip install -e ".[test]"``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch


def _load(path: str) -> tuple[np.ndarray, np.ndarray]:
    data = np.load(path)
    return data["features"].astype(np.float32), data["labels"].astype(np.int64)


def _quick() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    g = np.random.default_rng(0)
    centres = g.normal(size=(10, 32)).astype(np.float32)
    y, yt = g.integers(0, 10, 600), g.integers(0, 10, 200)
    x = centres[y] + 2.0 * g.normal(size=(600, 32)).astype(np.float32)
    xt = centres[yt] + 2.0 * g.normal(size=(200, 32)).astype(np.float32)
    return x, y, xt, yt


def main(argv: list[str] | None = None) -> int:
    from omegaconf import OmegaConf
    from sklearn.linear_model import LogisticRegression

    from sslkit.config.schema import schema
    from sslkit.evaluation.probes import stratified_split
    from sslkit.tools.bench.protocols import Features, fit_linear, linear_hits

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", help="sslkit extract's .npz of the train split")
    parser.add_argument("--test", help="sslkit extract's .npz of the test split")
    parser.add_argument("--images", type=int, default=0, help="train images used (a seeded draw; 0: all)")
    parser.add_argument("--cs", type=float, nargs="+", default=[0.01, 0.1, 1.0, 10.0])
    parser.add_argument("--max-iter", type=int, default=3000)
    parser.add_argument("--quick", action="store_true", help="random features: checks that it runs")
    args = parser.parse_args(argv)
    if args.quick:
        x, y, xt, yt = _quick()
    elif args.train and args.test:
        (x, y), (xt, yt) = _load(args.train), _load(args.test)
    else:
        parser.error("give --train and --test (sslkit extract's files), or --quick")
    if args.images:
        keep = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))[:args.images].numpy()
        x, y = x[keep], y[keep]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    settings = OmegaConf.to_container(schema().eval.bench, resolve=True)
    cpu = torch.device("cpu")
    start = time.perf_counter()
    chosen, details = fit_linear(Features({"pool": x, "labels": y}), 10, settings, cpu)
    grid = float(linear_hits(chosen, Features({"pool": xt, "labels": yt}), cpu).mean())
    grid_s = time.perf_counter() - start
    fit, val = (i.numpy() for i in stratified_split(torch.from_numpy(y), float(settings["linear"]["val_fraction"]),
                                                     int(settings["seed"])))
    mean, std = x[fit].mean(0), x[fit].std(0)
    std[std == 0] = 1.0
    z, zt = (x - mean) / std, (xt - mean) / std
    start, rows = time.perf_counter(), []
    for c in args.cs:
        model = LogisticRegression(C=c, max_iter=args.max_iter).fit(z[fit], y[fit])
        rows.append({"C": c, "val": float((model.predict(z[val]) == y[val]).mean()),
                     "test": float((model.predict(zt) == yt).mean()), "iterations": int(model.n_iter_.max())})
    best = max(rows, key=lambda r: r["val"])  # the first of equals
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{len(y)} train images ({len(fit)} fitted, {len(val)} for validation), {len(yt)} test images, "
          f"{x.shape[1]} dimensions")
    print(f"grid: test top-1 {grid:.4f} (lr {details['chosen']['lr']:g}, {details['steps']} steps, at_edge "
          f"{details['at_edge']}), {grid_s:.1f} s")
    print(f"scikit-learn: test top-1 {best['test']:.4f} (C {best['C']:g}), {time.perf_counter() - start:.1f} s")
    print(f"difference (grid - scikit-learn): {grid - best['test']:+.4f}")
    print(json.dumps({"grid": grid, "sklearn": best["test"], "by_c": rows}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
