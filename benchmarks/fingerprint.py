"""Fingerprint every recipe's training: the losses of each step and a hash of the final state, to compare two commits.

A refactor that must not change what trains (the core reshape of issue 12) is checked by running this on
the commit before and after it and comparing: every recipe (the 19 of ``sslkit doctor``, CNN, ViT and distillation,
small as it runs them) runs 8 steps (2 epochs) of its own config on the synthetic data, in this process, on the CPU,
and the SHA-256 of its final model and loss tensors and the list of its logged losses must be equal.

    python benchmarks/fingerprint.py --out /tmp/before.json          # on the old commit
    python benchmarks/fingerprint.py --compare /tmp/before.json      # on the new one: exit 1 on a difference

About a minute on 2 cores. The hashes depend on the machine's torch build and CPU, so compare on one machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: On top of each recipe's small overrides (sslkit doctor's table, the tests' too): 2 epochs of 4 steps, every loss
#: logged, no kNN or TensorBoard.
RUN = ["machine.device=cpu", "optim.epochs=2", "log.every_n_steps=1", "eval.knn.enabled=false", "log.tensorboard=false"]


def fingerprint(recipe: str, extra: list[str]) -> dict[str, object]:
    """Train ``recipe`` small; its final state's hash and its logged losses."""
    import torch

    from sslkit.launch.cli import main
    from sslkit.launch.doctor import SMALL, SMALL_RECIPES

    with tempfile.TemporaryDirectory() as out:
        code = main([f"config={recipe}", *SMALL, *SMALL_RECIPES[recipe], *RUN, *extra, f"output_dir={out}"])
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
    from sslkit.launch.doctor import SMALL_RECIPES, small_teacher

    small_teacher()  # the small distillation's teacher file
    found = {recipe: fingerprint(recipe, args.overrides) for recipe in SMALL_RECIPES}
    if args.out:
        Path(args.out).write_text(json.dumps(found, indent=1))
    for recipe, fp in found.items():
        print(f"{recipe:<14}{fp['hash'][:16]}  last loss {fp['losses'][-1]:.6f}")
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        differ = [r for r in found if r in before and before[r] != found[r]]
        new = [r for r in found if r not in before]
        print("identical: every recipe" if not differ else f"different: {', '.join(differ)}",
              f"(new since: {', '.join(new)})" if new else "")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
