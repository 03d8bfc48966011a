"""sslkit's trainer against a plain hand-written PyTorch loop: same model, data, seed and optimizer.

    python benchmarks/overhead.py [--steps 60] [--rounds 3] [key=value ...]

Both loops run in this process, alternating ``--rounds`` times, each for ``--steps`` optimizer
steps from the same initial state on the same batches. Prints the median step time of each, their
ratio, and whether the weights after the steps are bit-identical. Overrides (``data.batch_size=128``)
apply to both. Run it through ``python benchmarks/overhead.py``: like tools/run.py it re-execs once
with glibc's malloc thresholds raised, so both loops get the same allocator settings.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time

from sslkit.runtime import reexec_with_tuned_malloc

reexec_with_tuned_malloc()  # same allocator settings as tools/run.py, before torch is imported

import torch  # noqa: E402

from sslkit.builder import build_task  # noqa: E402
from sslkit.cli import setup_logging  # noqa: E402
from sslkit.config.compose import compose_config  # noqa: E402
from sslkit.hooks.base import SSLHook  # noqa: E402
from sslkit.optim import set_lr  # noqa: E402
from sslkit.task import SSLTask  # noqa: E402
from sslkit.train_steps.sample import to_sample  # noqa: E402
from sslkit.train_steps.standard import standard_train_step  # noqa: E402
from sslkit.trainer import train  # noqa: E402


class StepClock(SSLHook):
    """Records the time of every on_step: the intervals are whole steps, hooks included."""

    priority = 100

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_phase_start(self, task: SSLTask) -> None:
        self.times.append(time.perf_counter())

    def on_step(self, task: SSLTask) -> None:
        self.times.append(time.perf_counter())


def sslkit_loop(cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    task = build_task(cfg)
    clock = StepClock()
    task.hooks.append(clock)
    train(task, standard_train_step)
    return [b - a for a, b in itertools.pairwise(clock.times)], task.base_model.state_dict()


def plain_loop(cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    """What a researcher would write by hand, sharing only the construction with sslkit."""
    task = build_task(cfg)  # same seed -> same model init, loader, optimizer, schedule
    model, loss_fn, opt = task.model, task.loss, task.optimizer
    loader, device = task.loaders["train"], task.device
    loader.sampler.set_epoch(0)
    times = [time.perf_counter()]
    for step, batch in enumerate(loader):
        if step == task.max_iterations:
            break
        sample = to_sample(batch, device, task.channels_last)
        out = model(sample["input"])
        loss = loss_fn(out, sample)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        set_lr(opt, task.lr_schedule(step / task.max_iterations))
        opt.step()
        if (step + 1) % cfg.log.every_n_steps == 0:
            print(f"  plain step {step + 1} loss {loss.item():.4f}", flush=True)
        times.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(times)], model.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5, help="steps of each run left out of the median")
    args, overrides = parser.parse_known_args()
    out = tempfile.mkdtemp(prefix="sslkit_overhead_")
    cfg = compose_config([
        "config=simclr", f"optim.max_steps={args.steps}", "eval.knn.enabled=false", "log.tensorboard=false",
        "log.progress_bar=false", "checkpoint.every_n_epochs=0", f"output_dir={out}", *overrides,
    ])
    setup_logging(None)
    import logging

    logging.getLogger("sslkit").setLevel(logging.WARNING)
    print(f"{args.rounds} rounds x {args.steps} steps, batch {cfg.data.batch_size}, trunk {cfg.model.trunk}, "
          f"{torch.get_num_threads()} threads, device {cfg.machine.device}")
    ours: list[float] = []
    plain: list[float] = []
    identical = True
    for r in range(args.rounds):
        t_ours, w_ours = sslkit_loop(cfg)
        t_plain, w_plain = plain_loop(cfg)
        ours += t_ours[args.warmup:]
        plain += t_plain[args.warmup:]
        same = all(torch.equal(w_ours[k], w_plain[k]) for k in w_plain)
        identical &= same
        print(f"round {r}: sslkit {statistics.median(t_ours[args.warmup:]) * 1e3:.1f} ms/step, "
              f"plain {statistics.median(t_plain[args.warmup:]) * 1e3:.1f} ms/step, weights identical: {same}")
    m_ours, m_plain = statistics.median(ours), statistics.median(plain)
    print(f"median step: sslkit {m_ours * 1e3:.1f} ms, plain PyTorch {m_plain * 1e3:.1f} ms, "
          f"ratio {m_ours / m_plain:.3f} (overhead {100 * (m_ours / m_plain - 1):+.1f}%)")
    print(f"weights after {args.steps} steps identical (torch.equal, every tensor, every round): {identical}")


if __name__ == "__main__":
    main()
