"""Fingerprint every recipe's training: the losses of each step and a hash of the final state, to compare two commits.

A refactor that must not change what trains (the core reshape of issue 12) is checked by running this on
the commit before and after it and comparing: every recipe runs 8 steps (2 epochs) of its own config on
the synthetic data with a small trunk, in this process, on the CPU, and the SHA-256 of its final model and
loss tensors and the list of its logged losses must be equal.

    python benchmarks/fingerprint.py --out /tmp/before.json          # on the old commit
    python benchmarks/fingerprint.py --compare /tmp/before.json      # on the new one: exit 1 on a difference

About 20 s on 2 cores. The hashes depend on the machine's torch build and CPU, so compare on one machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: The overrides that make each recipe small (tests/helpers.py's RECIPES and SMALL at the time of writing).
SMALL = ["machine.device=cpu", "data=synthetic", "data.train.kwargs.num_samples=64", "data.batch_size=16",
         "data.num_workers=0", "model.head.hidden_dim=32", "model.head.out_dim=16", "model.trunk_kwargs={width: 8}",
         "optim.epochs=2", "log.every_n_steps=1", "eval.knn.enabled=false", "log.tensorboard=false"]
RECIPES = {
    "simclr": [], "moco": ["loss.queue_size=40"], "mocov3": ["model.kwargs.predictor_hidden_dim=32"],
    "byol": ["model.kwargs.predictor_hidden_dim=32"], "simsiam": ["model.kwargs.predictor_hidden_dim=8"],
    "swav": ["loss.queue_length=16", "loss.queue_start_iter=0", "model.kwargs.num_prototypes=10",
             "data.transform.num_small=2"],
    "dino": ["data.transform.num_small=2", "model.head.bottleneck_dim=8"], "barlow_twins": [], "vicreg": [],
}


def fingerprint(recipe: str, extra: list[str]) -> dict[str, object]:
    """Train ``recipe`` small; its final state's hash and its logged losses."""
    import torch

    from sslkit.cli import main

    with tempfile.TemporaryDirectory() as out:
        code = main([f"config={recipe}", *SMALL, *RECIPES[recipe], *extra, f"output_dir={out}"])
        if code != 0:
            raise SystemExit(f"{recipe}: the run failed (exit {code})")
        ckpts = Path(out) / "checkpoints"
        state = torch.load(ckpts / (ckpts / "latest.txt").read_text().strip(), weights_only=False)
        digest = hashlib.sha256()
        for part in ("model", "loss"):
            for key, value in sorted(state[part].items()):
                if isinstance(value, torch.Tensor):
                    digest.update(key.encode())
                    digest.update(value.detach().float().cpu().numpy().tobytes())
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in records if "loss" in r and "step" in r]
    return {"hash": digest.hexdigest(), "losses": losses}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the fingerprints to this JSON file")
    parser.add_argument("--compare", help="compare with the fingerprints in this JSON file; exit 1 on a difference")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every recipe")
    args = parser.parse_args(argv)
    found = {recipe: fingerprint(recipe, args.overrides) for recipe in RECIPES}
    if args.out:
        Path(args.out).write_text(json.dumps(found, indent=1))
    for recipe, fp in found.items():
        print(f"{recipe:<14}{fp['hash'][:16]}  last loss {fp['losses'][-1]:.6f}")
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        differ = [r for r in found if before.get(r) != found[r]]
        print("identical: every recipe" if not differ else f"different: {', '.join(differ)}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
