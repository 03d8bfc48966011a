"""The ``tools/run.py`` entry point: compose the config, set up the output folder, build, resume, train."""

from __future__ import annotations

import logging
import os
import sys

from omegaconf import DictConfig, OmegaConf

from sslkit import registry as R
from sslkit.checkpoint import checkpoint_dir, load_checkpoint
from sslkit.config.compose import ConfigError, compose_config
from sslkit.data.sources import DataSourceError
from sslkit.distributed import get_rank, init_process_group, launch, launched_by_torchrun, shutdown
from sslkit.reliability import PREEMPTED_EXIT_CODE, Preempted, TrainingHalted
from sslkit.task import SSLTask

__all__ = ["main", "run", "setup_logging"]

logger = logging.getLogger("sslkit")


def setup_logging(output_dir: str | None, rank: int = 0) -> None:
    """Log to stdout (rank 0; warnings only elsewhere) and to ``<output_dir>/log.txt`` on rank 0."""
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    fmt = logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S")
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(fmt)
    stream.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.addHandler(stream)
    if output_dir is not None and rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        file = logging.FileHandler(os.path.join(output_dir, "log.txt"))
        file.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(message)s"))
        logger.addHandler(file)


def run(cfg: DictConfig) -> SSLTask:
    """Train with a composed config: write config.yaml, build the task, auto-resume, train."""
    from sslkit.builder import build_task
    from sslkit.trainer import train

    rank = get_rank()
    setup_logging(cfg.output_dir, rank)
    if rank == 0:
        text = OmegaConf.to_yaml(cfg, resolve=True)
        logger.info("config:\n%s", text)
        with open(os.path.join(cfg.output_dir, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(text)
    task = build_task(cfg)
    if cfg.checkpoint.auto_resume:
        # Loaded on the CPU: RNG states must be CPU tensors, and load_state_dict moves model, loss and
        # optimizer state onto the device of the tensors they are copied into.
        found = load_checkpoint(checkpoint_dir(cfg.output_dir), map_location="cpu")
        if found is not None:
            state, path = found
            task.load_state_dict(state)
            logger.info("resumed from %s", path)
    step = R.get(R.TRAIN_STEPS, cfg.train_step, "train_step")
    train(task, step)
    return task


def main(argv: list[str] | None = None) -> int:
    """``python tools/run.py config=simclr a.b=c ...``; returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__ + "\n\nusage: python tools/run.py [config=NAME] [data=NAME] [key=value ...]\n"
              "Every key is documented in sslkit/config/defaults.yaml and docs/configs.md.")
        return 0
    try:
        cfg = compose_config(args)
    except (ConfigError, R.UnknownNameError) as exc:
        print(f"sslkit: config error: {exc}", file=sys.stderr)
        return 2
    d = cfg.distributed
    try:
        if launched_by_torchrun():
            init_process_group(d.backend, d.timeout_s, cfg.machine.device)
            try:
                run(cfg)
            finally:
                shutdown()
        elif d.nproc_per_node > 1 or d.num_nodes > 1:
            return _launch_workers(args, cfg)
        else:
            run(cfg)
    except Preempted as exc:
        print(f"sslkit: {exc}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except TrainingHalted as exc:
        print(f"sslkit: stopped: {exc}", file=sys.stderr)
        return 1
    except DataSourceError as exc:
        print(f"sslkit: data error: {exc}", file=sys.stderr)
        return 2
    return 0


def _launch_workers(args: list[str], cfg: DictConfig) -> int:
    """Spawn this node's workers and turn their failures into a message and an exit status."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    d = cfg.distributed
    try:
        launch(_worker_main, (args,), d.nproc_per_node, d.num_nodes, d.node_rank, d.master_addr,
               d.master_port, d.backend, d.timeout_s, cfg.machine.device)
    except ProcessExitedException as exc:
        if exc.exit_code == PREEMPTED_EXIT_CODE:
            print("sslkit: pre-empted; the checkpoint was written. Run the same command again to resume.",
                  file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        print(f"sslkit: a worker died ({exc}); all workers were stopped. Running the same command resumes "
              "from the last checkpoint.", file=sys.stderr)
        return 1
    except ProcessRaisedException as exc:
        print(f"sslkit: a worker failed; all workers were stopped.\n{exc}", file=sys.stderr)
        return 1
    return 0


def _worker_main(args: list[str]) -> None:
    """Entry point of a spawned worker: compose the same config (imports included) and run.
    A pre-empted worker exits with :data:`PREEMPTED_EXIT_CODE` (rank 0 has logged why)."""
    try:
        run(compose_config(args))
    except Preempted:
        sys.exit(PREEMPTED_EXIT_CODE)
