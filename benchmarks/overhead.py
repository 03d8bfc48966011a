"""sslkit's trainer against a plain hand-written PyTorch loop: same model, data, seed, optimizer and precision.

    python benchmarks/overhead.py [--steps 60] [--rounds 3] [--warmup 5] [key=value ...]

Both loops run in this process, alternating ``--rounds`` times (sslkit first in even rounds, the
plain loop first in odd ones), each for ``--steps`` optimizer steps from the same initial state on
the same batches. Overrides (``data.batch_size=128``, ``amp.enabled=true``, ``config=byol``) apply
to both. The plain loop mirrors what sslkit's standard step does to the numbers:

* the same device, model (channels_last as configured), loss, optimizer and GradScaler, all from
  ``build_task``, and the same batches (``prepare_sample``: on the device, augmented there under
  ``data.augment_on=device``);
* the same precision: forward and loss under ``torch.autocast(device_type, dtype)`` when
  ``amp.enabled=true``; with float16, ``scaler.scale(loss).backward()``, ``scaler.step``,
  ``scaler.update``;
* per step: ``zero_grad(set_to_none=True)`` before the backward, the lr (and weight decay, when
  the recipe schedules it) for ``where = step / max_steps`` set just before ``optimizer.step``,
  ``optim.micro_batches`` micro-batches with ``backward(loss / K)``, the gradients clipped as
  ``optim.clip_grad`` says (after unscaling), and a masked method's masks passed to the model
  (``model(views, masks=...)``, drawn by the same sample stage: ``model_keywords``);
* the method hooks of the recipe (momentum teachers, SwAV's prototype normalisation, DINO's
  last-layer freeze, the collapse monitor), the very hook objects ``build_task`` made, called at
  the same events. Only sslkit's infrastructure (logging, checkpointing, the non-finite loss guard,
  the pre-emption check, kNN, consistency checks, timers, meters, the hook dispatch) is left out:
  that is the overhead measured.

So the weights (model and loss state) after the steps must be bit-identical; the last line says
whether they are, every round (exit status 1 if not). On CUDA that holds for kernels that are
deterministic: with ``machine.deterministic=false`` cuDNN autotunes and some kernels add with
atomics, so a difference is then reported with its size, and ``machine.deterministic=true`` is
the bit-identical check.

Timing: the first ``--warmup`` steps of each run are left out. The "mean" figures are wall time
over the remaining steps as one block, with the device synchronised at the block's start and end
(``torch.cuda.synchronize``; nothing on CPU). The "median" figures are per-step intervals: host
time on CPU, CUDA events recorded at each step boundary on CUDA (no synchronisation inside the
loop, so the GPU queue runs as in training). Run it through ``python benchmarks/overhead.py``:
like tools/run.py it re-execs once with glibc's malloc thresholds raised, so both loops get the
same allocator settings.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sslkit.launch.runtime import reexec_with_tuned_malloc

reexec_with_tuned_malloc()  # same allocator settings as tools/run.py, before torch is imported

import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from sslkit.builder import build_task  # noqa: E402
from sslkit.config.compose import compose_config  # noqa: E402
from sslkit.console import setup_logging  # noqa: E402
from sslkit.data.seeding import mix_seed  # noqa: E402
from sslkit.hooks import CheckpointHook, ConsistencyCheckHook, KNNHook, LogHook  # noqa: E402
from sslkit.hooks.base import Event, SSLHook  # noqa: E402
from sslkit.hooks.preemption import PreemptionHook  # noqa: E402
from sslkit.optim import set_lr, set_weight_decay  # noqa: E402
from sslkit.task import MicroBatch, SSLTask  # noqa: E402
from sslkit.train_steps.sample import prepare_sample  # noqa: E402
from sslkit.train_steps.stages import model_keywords  # noqa: E402
from sslkit.train_steps.standard import standard_train_step  # noqa: E402
from sslkit.trainer import train  # noqa: E402

#: sslkit's own machinery: what the plain loop leaves out (the overhead being measured).
INFRASTRUCTURE_HOOKS: tuple[type[SSLHook], ...] = (
    LogHook, CheckpointHook, PreemptionHook, KNNHook, ConsistencyCheckHook,
)


# ------------------------------------------------------------------------------------------ timing
class Clock:
    """Step boundaries of one run, read the same way by both loops.

    :meth:`start` before the first step, :meth:`step` after every step. After step ``warmup``
    the device is synchronised and the block's wall clock starts; after step ``total`` it is
    synchronised again and the block ends. Per-step intervals come from host time on CPU and
    from CUDA events on CUDA (recorded on the current stream, read once at the end).
    """

    def __init__(self, device: torch.device, warmup: int, total: int) -> None:
        """Time ``total`` steps on ``device``, the first ``warmup`` of them left out."""
        if not 0 <= warmup < total:
            raise ValueError(f"--warmup {warmup} leaves no step to time out of {total}")
        self.device = device
        self.cuda = device.type == "cuda"
        self.warmup = warmup
        self.total = total
        self.steps = 0
        self._host: list[float] = []
        self._events: list[torch.cuda.Event] = []
        self.block_start: float | None = None
        self.block_end: float | None = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)
        else:
            self._host.append(time.perf_counter())

    def start(self) -> None:
        """Before the first step (once per run)."""
        if self.warmup == 0:
            self._sync()
            self.block_start = time.perf_counter()
        self._mark()

    def step(self) -> None:
        """After each step."""
        self.steps += 1
        self._mark()
        if self.steps == self.warmup:
            self._sync()
            self.block_start = time.perf_counter()
        if self.steps == self.total:
            self._sync()
            self.block_end = time.perf_counter()

    def intervals(self) -> list[float]:
        """Seconds per step after the warm-up (call after the last step)."""
        if self.cuda:
            self._sync()
            times = [a.elapsed_time(b) / 1e3 for a, b in zip(self._events, self._events[1:])]
        else:
            times = [b - a for a, b in zip(self._host, self._host[1:])]
        return times[self.warmup:]

    def block_seconds(self) -> float:
        """Synchronised wall time of the steps after the warm-up."""
        if self.block_start is None or self.block_end is None:
            raise RuntimeError(f"the run made {self.steps} of {self.total} steps: the timed block never ended")
        return self.block_end - self.block_start


class StepClock(SSLHook):
    """Feeds a :class:`Clock` from sslkit's events; appended after the hooks are ordered, it runs after
    every other hook, so an interval is a whole step, hooks included."""

    def __init__(self, clock: Clock) -> None:
        """Drive ``clock``."""
        self.clock = clock
        self.started = False

    def on_phase_start(self, task: SSLTask) -> None:
        """Start the clock at the first phase; later phase boundaries fall inside a step's interval."""
        if not self.started:
            self.started = True
            self.clock.start()

    def on_step(self, task: SSLTask) -> None:
        """One step done."""
        self.clock.step()


@dataclass
class RunResult:
    """What one run of either loop produced."""

    #: Seconds per step after the warm-up (host time on CPU, CUDA events on CUDA).
    step_times: list[float]
    #: Synchronised wall time of the steps after the warm-up, and their number.
    block_seconds: float
    block_steps: int
    #: The model's state and the loss's (queues, centres) under ``loss.``, after the last step.
    weights: dict[str, Any] = field(repr=False)

    @property
    def mean(self) -> float:
        """Seconds per step over the synchronised block."""
        return self.block_seconds / self.block_steps

    @property
    def median(self) -> float:
        """Median seconds per step."""
        return statistics.median(self.step_times)


def _weights(task: SSLTask) -> dict[str, Any]:
    state = dict(task.base_model.state_dict())
    state.update({f"loss.{k}": v for k, v in task.loss.state_dict().items()})
    return state


def _result(clock: Clock, task: SSLTask) -> RunResult:
    return RunResult(clock.intervals(), clock.block_seconds(), clock.total - clock.warmup, _weights(task))


# ------------------------------------------------------------------------------------------ loops
def method_hooks(task: SSLTask) -> list[SSLHook]:
    """The recipe's own hooks in ``task.hooks`` (slot order): everything but sslkit's infrastructure."""
    return [h for h in task.hooks if not isinstance(h, (*INFRASTRUCTURE_HOOKS, StepClock))]


def check_supported(task: SSLTask) -> None:
    """Refuse what the plain loop does not mirror, with the reason."""
    cfg = task.config
    if cfg is not None and cfg.train_step != "standard":
        raise SystemExit(f"train_step={cfg.train_step}: the plain loop mirrors only the standard train step")
    if task.world_size > 1:
        raise SystemExit("the overhead benchmark runs one process: start it with python, not torchrun, and "
                         "leave distributed.nproc_per_node at 1")
    if not all(p.train for p in task.phases):
        raise SystemExit("the plain loop mirrors train phases only")


def sslkit_loop(cfg: DictConfig, warmup: int) -> RunResult:
    """Train ``cfg`` with sslkit's trainer and standard step; time every step at ``on_step``."""
    task = build_task(cfg)
    check_supported(task)
    clock = Clock(task.device, warmup, task.clock.max_steps)
    task.hooks.append(StepClock(clock))  # appended after the ordering: stays last
    train(task, standard_train_step)
    return _result(clock, task)


def _dispatcher(hooks: Sequence[SSLHook], task: SSLTask) -> Callable[[Event], None]:
    """``fire(event)`` calls ``event`` on the hooks that override it, in their order."""
    by_event = {
        event: [getattr(h, event.value) for h in hooks
                if getattr(type(h), event.value) is not getattr(SSLHook, event.value)]
        for event in Event
    }

    def fire(event: Event) -> None:
        for method in by_event[event]:
            method(task)

    return fire


def plain_loop(cfg: DictConfig, warmup: int) -> RunResult:
    """What a researcher would write by hand, sharing with sslkit only the construction and the
    method hooks (EMA teachers and the like, the same objects at the same events).

    ``task`` is used as the hooks' view of the run: the loop keeps ``task.clock.step``, ``task.clock.epoch``,
    ``task.phase_idx`` (the epoch) and ``task.last_batch`` current because hooks read them.
    """
    task = build_task(cfg)  # same seed -> same model init, loader, optimizer, schedules, hooks
    check_supported(task)
    model, loss_fn, opt, scaler = task.model, task.loss, task.optimizer, task.scaler
    loader, device, accumulate = task.loaders["train"], task.device, task.micro_batches
    max_steps, log_every = task.clock.max_steps, cfg.log.every_n_steps
    dtype, clip = task.amp_dtype, float(cfg.optim.clip_grad)
    precision = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype is not None else contextlib.nullcontext
    fire = _dispatcher(method_hooks(task), task)
    clock = Clock(device, warmup, max_steps)
    step = 0
    fire(Event.ON_START)
    for epoch in range(len(task.phases)):
        if step == max_steps:
            break
        task.phase_idx = task.clock.epoch = epoch
        if loader.generator is None:  # as SSLTask.start_phase: the loader's seed draw leaves the global RNG alone
            loader.generator = torch.Generator()
        loader.generator.manual_seed(mix_seed(task.seed, epoch))
        loader.sampler.set_epoch(epoch)
        batches = iter(loader)
        fire(Event.ON_PHASE_START)
        if step == 0:
            clock.start()
        while step < max_steps:
            task.clock.step = step
            try:
                task.clock.micro_batches = accumulate
                for micro in range(accumulate):
                    task.clock.micro_batch = micro
                    # on the device, augmented there under data.augment_on=device, as sslkit's sample stage
                    sample = prepare_sample(task, next(batches))
                    task.last_batch = MicroBatch(sample=sample)
                    with precision():
                        # masks (drawn by the sample stage) and teacher crops, handed over as sslkit's step does
                        output = model(sample["input"], **model_keywords(sample))
                        task.last_batch.model_output = output
                        fire(Event.ON_FORWARD)
                        loss = loss_fn(output, sample, task.context())  # the clock, for schedules
                    if isinstance(loss, dict):
                        loss = loss["loss"]
                    task.last_batch.loss = loss
                    fire(Event.ON_LOSS_AND_METER)
                    if micro == 0:
                        opt.zero_grad(set_to_none=True)
                    scaled = loss / accumulate if accumulate > 1 else loss
                    if scaler is not None:
                        scaler.scale(scaled).backward()
                    else:
                        scaled.backward()
            except StopIteration:  # the epoch ran out (an incomplete accumulation is dropped)
                break
            fire(Event.ON_BACKWARD)
            if clip > 0:  # after accumulation, on unscaled gradients
                if scaler is not None:
                    scaler.unscale_(opt)
                params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
                if cfg.optim.clip_grad_mode == "per_parameter":  # DINO's clip_gradients
                    for p in params:
                        norm = p.grad.norm()
                        p.grad.mul_((clip / (norm + 1e-6)).clamp(max=1.0))
                else:
                    torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)  # CUDA's default; on the CPU too
            set_lr(opt, task.lr_schedule.at(task.clock))  # the loop keeps task.clock.step at this step
            if task.wd_schedule is not None:
                set_weight_decay(opt, task.wd_schedule.at(task.clock))
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            fire(Event.ON_UPDATE)
            step += 1
            task.clock.step = step
            task.clock.samples += task.global_batch_size
            if step % log_every == 0:
                print(f"  plain step {step} loss {loss.item():.4f}", flush=True)
            fire(Event.ON_STEP)
            clock.step()
        fire(Event.ON_PHASE_END)
    fire(Event.ON_END)
    return _result(clock, task)


# ------------------------------------------------------------------------------------------ report
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def precision_name(cfg: DictConfig) -> str:
    """``fp32``, ``bf16 autocast`` or ``fp16 autocast + GradScaler``."""
    if not cfg.amp.enabled:
        return "fp32"
    return "bf16 autocast" if cfg.amp.dtype == "bfloat16" else "fp16 autocast + GradScaler"


def machine_header(cfg: DictConfig, device: torch.device) -> list[str]:
    """Lines naming the machine and the settings, to paste next to the figures."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        f"machine: {_cpu_model()}, {os.cpu_count()} cores ({usable} usable), {torch.get_num_threads()} torch "
        f"threads, python {platform.python_version()}, torch {torch.__version__}",
    ]
    dev = str(device)
    if device.type == "cuda":
        dev += f" ({torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda})"
    deterministic = OmegaConf.select(cfg, "machine.deterministic", default=None)
    det = f"machine.deterministic={deterministic}" if deterministic is not None else "machine.deterministic unset"
    lines.append(f"device {dev}, precision {precision_name(cfg)}, channels_last {cfg.machine.channels_last}, "
                 f"{det} (torch deterministic algorithms: {torch.are_deterministic_algorithms_enabled()})")
    return lines


def bench_config(steps: int, overrides: Sequence[str], output_dir: str) -> DictConfig:
    """The SimCLR recipe for ``steps`` steps without kNN, TensorBoard, progress bar or per-epoch checkpoints;
    ``overrides`` last."""
    return compose_config([
        "config=simclr", f"optim.max_steps={steps}", "eval.knn.enabled=false", "log.tensorboard=false",
        "log.progress_bar=false", "checkpoint.every_n_epochs=0", f"output_dir={output_dir}", *overrides,
    ])


def identical(a: Any, b: Any) -> bool:
    """``torch.equal`` on every tensor of two (nested) states, ``==`` on the rest (``_extra_state``)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def largest_difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, float]:
    """The tensor of ``a`` and ``b`` that differs most (max absolute difference), for the report when
    :func:`identical` fails: rounding-level on CUDA without determinism, large for a real mismatch."""
    worst, name = 0.0, ""
    for key in a.keys() & b.keys():
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item() if x.shape == y.shape else float("inf")
            if diff >= worst:
                worst, name = diff, key
    return (name, worst) if name or a.keys() == b.keys() else ("(different keys)", float("inf"))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison and print it; returns 0, or 1 when the weights differ in any round."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5, help="steps of each run left out of the timing")
    args, overrides = parser.parse_known_args(argv)
    if bad := [o for o in overrides if "=" not in o]:
        parser.error(f"not an option nor a key=value override: {' '.join(bad)}")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    out = tempfile.mkdtemp(prefix="sslkit_overhead_")
    try:
        return _compare(args, bench_config(args.steps, overrides, out))
    except KeyboardInterrupt:
        print("overhead.py: interrupted; nothing was measured to the end", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(out, ignore_errors=True)  # the runs' checkpoints and logs: scratch, never kept


def _compare(args: argparse.Namespace, cfg: DictConfig) -> int:
    """The rounds of :func:`main` with the composed ``cfg``; returns main's exit status."""
    setup_logging(None)
    logging.getLogger("sslkit").setLevel(logging.WARNING)

    probe = build_task(cfg)  # the device, the shared hooks, and the refusals before anything is timed
    check_supported(probe)
    device, shared = probe.device, [type(h).__name__ for h in method_hooks(probe)]
    workers = probe.loaders["train"].num_workers
    del probe
    for line in machine_header(cfg, device):
        print(line)
    print(f"{args.rounds} rounds x {args.steps} steps ({args.warmup} warm-up), recipe loss {cfg.loss.name}, "
          f"trunk {cfg.model.trunk}, data {cfg.data.train.source} ({workers} loader workers), "
          f"batch {cfg.data.batch_size} x {cfg.optim.micro_batches} accumulated, "
          f"method hooks in both loops: {', '.join(shared) or 'none'}")
    print(f"median: per-step {'CUDA-event' if device.type == 'cuda' else 'host'} intervals; "
          "mean: synchronised wall time of the block after warm-up / its steps", flush=True)

    runs: dict[str, list[RunResult]] = {"sslkit": [], "plain": []}
    loops: dict[str, Callable[[DictConfig, int], RunResult]] = {"sslkit": sslkit_loop, "plain": plain_loop}
    all_same = True
    for r in range(args.rounds):
        order = ("sslkit", "plain") if r % 2 == 0 else ("plain", "sslkit")
        got: dict[str, RunResult] = {}
        for name in order:
            gc.collect()  # the previous run's garbage (its loader, model, optimizer) goes before the clock starts
            got[name] = loops[name](cfg, args.warmup)
        same = identical(got["sslkit"].weights, got["plain"].weights)
        all_same &= same
        if not same:
            key, diff = largest_difference(got["sslkit"].weights, got["plain"].weights)
            print(f"  round {r}: weights differ, most in {key}: max |sslkit - plain| = {diff:.3g}")
        for name, result in got.items():
            result.weights = {}  # free the copies before the next round
            runs[name].append(result)
        o, p = got["sslkit"], got["plain"]
        print(f"round {r}: sslkit {o.median * 1e3:.1f} ms/step median, {o.mean * 1e3:.1f} mean; "
              f"plain {p.median * 1e3:.1f} median, {p.mean * 1e3:.1f} mean; weights identical: {same}", flush=True)

    med = {k: statistics.median(t for run in v for t in run.step_times) for k, v in runs.items()}
    mean = {k: sum(run.block_seconds for run in v) / sum(run.block_steps for run in v) for k, v in runs.items()}
    for label, m in (("median step", med), ("mean step", mean)):
        ratio = m["sslkit"] / m["plain"]
        print(f"{label}: sslkit {m['sslkit'] * 1e3:.1f} ms, plain PyTorch {m['plain'] * 1e3:.1f} ms, "
              f"ratio {ratio:.3f} (overhead {100 * (ratio - 1):+.1f}%) [{precision_name(cfg)}, {device.type}]")
    print(f"weights after {args.steps} steps identical (torch.equal, every tensor, every round): {all_same}")
    if not all_same and device.type == "cuda" and not cfg.machine.deterministic:
        print("note: machine.deterministic=false on CUDA: cuDNN autotuning and atomic-add kernels can make any two "
              "runs differ in the last bits; rerun with machine.deterministic=true for the bit-identical check")
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
