"""The ``tools/run.py`` entry point: compose the config, set up the output folder, build, resume, train.

Light to import (no torch): ``sslkit --help`` and ``python tools/run.py --help`` answer before torch would have
loaded; every function imports what it runs (tests/test_suite.py holds the list of what must stay out).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from sslkit.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    STORAGE_ERRNOS,
    UserError,
    storage_error,
    worker_message,
)

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from sslkit.launch.runfolder import FolderPlan
    from sslkit.task import SSLTask

__all__ = ["console", "main", "run"]

logger = logging.getLogger("sslkit")


def run(cfg: DictConfig, plan: FolderPlan | None = None, summary: str | None = None,
        argv: list[str] | None = None) -> SSLTask:
    """Train with a composed config: write config.yaml (and command.json), build the task, auto-resume, train.

    ``plan`` is what :func:`~sslkit.launch.runfolder.prepare_output_dir` decided for the folder (made by
    :func:`main` before any worker starts); ``summary`` the config as a diff against its recipe; ``argv``
    the command-line arguments, kept in the folder for the run's report.
    """
    from sslkit import registry as R
    from sslkit.builder import build_task
    from sslkit.checkpoint import Checkpointer
    from sslkit.console import setup_logging
    from sslkit.data import notices
    from sslkit.distributed import get_rank
    from sslkit.hooks.trackers import finish_trackers
    from sslkit.launch.runfolder import write_command, write_config
    from sslkit.trainer import train

    rank = get_rank()
    setup_logging(cfg.output_dir, rank)
    if rank == 0:
        if plan is not None:
            plan.log()
        write_config(cfg)
        if argv is not None:
            write_command(cfg.output_dir, argv)
        logger.info("%s", summary or f"config: {cfg.name}; the full config is in "
                    f"{os.path.join(cfg.output_dir, 'config.yaml')}")
    with notices.kept_in(cfg.output_dir):  # data warnings said once for the run, over its ranks and workers
        task = build_task(cfg)
        try:
            if cfg.checkpoint.auto_resume and (path := Checkpointer(cfg.output_dir).resume(task)) is not None:
                logger.info("resumed from %s", path)
            step = R.get(R.TRAIN_STEPS, cfg.train_step, "train_step")
            train(task, step)
        except BaseException as exc:
            finish_trackers(task, exc)  # W&B / MLflow: KILLED after a pre-emption or Ctrl-C, FAILED after an error
            raise
        finally:
            task.close()
    if rank == 0 and cfg.eval.bench.at_end:
        _end_bench(cfg)
    if rank == 0 and cfg.log.report:
        _write_report(cfg.output_dir)
    finish_trackers(task, artifacts=rank == 0 and bool(cfg.log.report))  # FINISHED, with report.md and plots
    return task


def _end_bench(cfg: DictConfig) -> None:
    """``eval.bench.at_end``: the finished run's bench (sslkit/tools/bench); a failure there is logged, never raised:
    the run's work is done and saved, and ``sslkit bench`` can measure it again."""
    try:
        from sslkit.tools.bench import bench_finished_run

        table = bench_finished_run(cfg, str(cfg.output_dir))
        logger.info("bench of the finished run: %s", table)
    except Exception as exc:
        logger.warning("the run's bench (eval.bench.at_end) was not done (%s: %s); sslkit bench backbones=[%s] "
                       "tries again", type(exc).__name__, exc, cfg.output_dir)


def _write_report(output_dir: str) -> None:
    """The finished run's summary (report.md) and plots (sslkit/tools/report.py); a failure there is logged, never
    raised: the run's work is done and saved."""
    try:
        from sslkit.tools.report import write_report

        text = write_report(output_dir)
        logger.info("%s\nsummary and plots: %s (again at any time: sslkit report %s)", text.rstrip(),
                    os.path.join(output_dir, "report.md"), output_dir)
    except Exception as exc:  # a plot library problem must not turn a finished run into a failed one
        logger.warning("the run's report was not written (%s: %s); sslkit report %s tries again",
                       type(exc).__name__, exc, output_dir)


def main(argv: list[str] | None = None) -> int:
    """``python tools/run.py config=simclr a.b=c ...``; returns the exit code.

    Every failure a user can cause (a config, a path, a folder, a full disk, a signal) ends with a
    message on stderr and an exit code (2: bad input, 1: stopped, 75: pre-empted with a checkpoint,
    130: interrupted at once), without a traceback unless ``--debug`` or ``SSLKIT_DEBUG=1``. A
    traceback means a bug in sslkit (or in user code it runs).
    """
    from sslkit.console import debug_flag, guard_streams

    if argv is None:  # this process's own command (tools/run.py): a closed pipe must not cost the checkpoint
        guard_streams()

    args, debug = debug_flag(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        _print(_usage())
        return 0
    logging.raiseExceptions = False  # a log file on a full disk must not print tracebacks
    try:
        return _main(args)
    except BaseException as exc:  # (sorted in _exit_status, which imports the classes: this module stays light)
        status = _exit_status(exc, debug)
        if status is None:
            raise
        return status


def _exit_status(exc: BaseException, debug: bool) -> int | None:
    """The exit status of a run that ended with ``exc``, its message printed; None for what is re-raised (a bug,
    or anything but a pre-emption with ``--debug``)."""
    from sslkit.launch.runtime import pair_problem

    problem = pair_problem(exc)  # before the imports below, which may need the torchvision that failed
    if problem is not None and not debug:
        print(f"sslkit: error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from sslkit import registry as R
    from sslkit.errors import PREEMPTED_EXIT_CODE
    from sslkit.guard import TrainingHalted
    from sslkit.reliability import Preempted

    if isinstance(exc, KeyboardInterrupt) and not debug:
        print("sslkit: interrupted at once (a second Ctrl-C, or one before training started); no checkpoint was "
              "written for the steps since the last one. Run the same command again to resume from the last "
              "checkpoint.", file=sys.stderr)
        return EXIT_INTERRUPTED
    if isinstance(exc, Preempted):
        from sslkit.distributed import launched_by_torchrun

        if not launched_by_torchrun() or os.environ.get("RANK", "0") == "0":  # rank 0 says it once
            print(f"sslkit: {exc}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    if debug:
        return None
    if isinstance(exc, TrainingHalted):
        print(f"sslkit: stopped: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    if isinstance(exc, UserError | R.UnknownNameError):
        from sslkit.config.schema import ConfigError
        from sslkit.data.sources import DataSourceError
        from sslkit.distributed import launched_by_torchrun

        if launched_by_torchrun() and os.environ.get("RANK", "0") != "0":
            return getattr(exc, "exit_code", EXIT_BAD_INPUT)  # rank 0 says it once, not every rank
        kind = "config error" if isinstance(exc, ConfigError | R.UnknownNameError) else (
            "data error" if isinstance(exc, DataSourceError) else "error")
        print(f"sslkit: {kind}: {worker_message(str(exc))}", file=sys.stderr)
        return getattr(exc, "exit_code", EXIT_BAD_INPUT)
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        print(f"sslkit: error: {storage_error(exc, 'to', str(exc.filename or '?'), known=False)}", file=sys.stderr)
        return EXIT_STOPPED
    return None


def _print(text: str) -> None:
    """Print to stdout; a reader that stops early (``sslkit list | head``) is not an error."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit


def _usage() -> str:
    from sslkit.launch.catalog import usage_text

    return usage_text()


def _main(args: list[str]) -> int:
    from sslkit.config.compose import compose_config
    from sslkit.config.diff import format_recipe_diff
    from sslkit.distributed import init_process_group, launched_by_torchrun, shutdown
    from sslkit.launch.runfolder import prepare_output_dir, resumable_checkpoint
    from sslkit.launch.slurm import in_slurm_task, submit

    cfg = compose_config(args)
    if cfg.model.freeze:  # validation builds no model: the globs are checked on one here, before anything is written
        from sslkit.builder.model import check_freeze

        check_freeze(cfg)
    if not launched_by_torchrun() and not in_slurm_task() and resumable_checkpoint(cfg) is None:
        from sslkit.builder.model import check_external_parts

        check_external_parts(cfg)  # a distillation's teacher read and fitted to the students, before the folder
    if cfg.eval.reference.sets:  # a reference set without labels or samples stops here, before the run folder
        from sslkit.builder.data import reference_sets

        reference_sets(cfg)
    if cfg.launcher == "slurm" and not in_slurm_task():
        return submit(cfg, args, main)  # (in the job's tasks the same command trains)
    import torchvision  # noqa: F401  (one that does not load with this torch stops here, before the run folder)

    d = cfg.distributed
    torchrun = launched_by_torchrun()
    plan = prepare_output_dir(cfg, primary=not torchrun or int(os.environ["RANK"]) == 0)
    summary = format_recipe_diff(args, cfg)
    if torchrun:
        init_process_group(d.backend, d.timeout_s, cfg.machine.device)
        try:
            run(cfg, plan, summary, args)
        finally:
            shutdown()
    elif d.nproc_per_node > 1 or d.num_nodes > 1:
        return _launch_workers(args, cfg, plan, summary)
    else:
        run(cfg, plan, summary, args)
    return 0


def _launch_workers(args: list[str], cfg: DictConfig, plan: FolderPlan, summary: str | None) -> int:
    """Spawn this node's training workers; their failures become a message and an exit status."""
    from sslkit.console import launch_workers

    d = cfg.distributed
    return launch_workers(_worker_main, (args, plan, summary), "sslkit", RESUMES, nproc_per_node=d.nproc_per_node,
                          num_nodes=d.num_nodes, node_rank=d.node_rank, master_addr=d.master_addr,
                          master_port=d.master_port, backend=d.backend, timeout_s=d.timeout_s,
                          device=cfg.machine.device)


#: What a training run's failure message ends with.
RESUMES = " Running the same command resumes from the last checkpoint."


def _worker_main(args: list[str], plan: FolderPlan | None = None, summary: str | None = None) -> None:
    """Entry point of a spawned worker: compose the same config (imports included) and run.

    A pre-empted worker exits with :data:`PREEMPTED_EXIT_CODE` (rank 0 has logged why); a user
    error is printed by rank 0 and ends the worker with its exit code, without a traceback.
    """
    from sslkit.config.compose import compose_config
    from sslkit.console import end_worker
    from sslkit.distributed import get_rank
    from sslkit.errors import PREEMPTED_EXIT_CODE
    from sslkit.guard import TrainingHalted
    from sslkit.reliability import Preempted

    try:
        run(compose_config(args), plan if get_rank() == 0 else None, summary, args)
    except Preempted:
        sys.exit(PREEMPTED_EXIT_CODE)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    except (UserError, TrainingHalted) as exc:
        end_worker(exc, "sslkit", "stopped" if isinstance(exc, TrainingHalted) else "error")
    except OSError as exc:
        if exc.errno not in STORAGE_ERRNOS:
            raise
        print(f"sslkit: error: {storage_error(exc, 'to', str(exc.filename or '?'), known=False)}", file=sys.stderr)
        sys.exit(EXIT_STOPPED)


#: ``sslkit <command>``: what each does (the tools also run as ``python tools/<name>.py``).
COMMANDS = {
    "train": "train a model (= python tools/run.py): sslkit train config=simclr [key=value ...]",
    "knn": "weighted kNN of a checkpoint's features (= tools/eval_knn.py): sslkit knn checkpoint=RUN_DIR",
    "linear": "linear probe on the frozen trunk (= tools/eval_linear.py): sslkit linear checkpoint=RUN_DIR",
    "finetune": "fine-tune the whole trunk with a linear head, MAE's protocol (= tools/eval_finetune.py): "
                "sslkit finetune checkpoint=RUN_DIR",
    "dense": "a linear segmentation probe on a ViT's frozen patch tokens, mIoU into RUN_DIR/eval/dense.json: "
             "sslkit dense checkpoint=RUN_DIR",
    "bench": "several backbones (runs, weights files, timm models, pixels, random init) on every protocol, one "
             "table: sslkit bench backbones=[RUN, pixels, random] data=fashion_mnist output=DIR",
    "extract": "features and labels to a file (= tools/extract_features.py): sslkit extract checkpoint=RUN_DIR "
               "split=test output=feats.npz",
    "export": "the trunk for torchvision (ResNets) or timm (ViTs), as safetensors or ONNX (= tools/export.py): "
              "sslkit export checkpoint=RUN_DIR [format=onnx]",
    "viz": "look at what the model learned: attention maps, patch PCA, an embedding map, nearest neighbours "
           "(= tools/visualize.py): sslkit viz checkpoint=RUN_DIR [kind=attention,pca,embedding,neighbors]",
    "report": "a finished run's summary and plots: sslkit report RUN_DIR",
    "data": "pack a folder of images into tar shards, say what a source holds, or write the offline dense task: "
            "sslkit data pack input=FOLDER output=SHARDS | sslkit data info path=SOURCE | sslkit data scenes "
            "output=FOLDER",
    "list": "what a config can name (methods, trunks, hooks, data sources, ...)",
    "doctor": "is this machine ready? versions, GPUs, a collective, every recipe a few steps, determinism: "
              "sslkit doctor [--device cuda] [--recipes simclr,dino_vit]",
}


def _command(name: str) -> Any:
    """The entry point of ``sslkit <name>``."""
    if name == "train":
        return main
    if name == "list":
        def listing(_args: list[str]) -> int:
            from sslkit.launch.catalog import catalog_text

            _print(catalog_text())
            return 0
        return listing
    if name == "export":
        from sslkit.tools.export import export_main

        return export_main
    if name == "finetune":
        from sslkit.tools.finetune import finetune_main

        return finetune_main
    if name == "report":
        from sslkit.tools.report import main as report_main

        return report_main
    if name == "doctor":
        from sslkit.launch.doctor import main as doctor_main

        return doctor_main
    if name == "viz":
        from sslkit.tools.viz import viz_main

        return viz_main
    if name == "dense":
        from sslkit.tools.dense import dense_main

        return dense_main
    if name == "data":
        from sslkit.tools.data import data_main

        return data_main
    if name == "bench":
        from sslkit.tools.bench import bench_main

        return bench_main
    from sslkit.tools import common as tools

    return {"knn": tools.knn_main, "linear": tools.linear_main, "extract": tools.extract_main}[name]


def console(argv: list[str] | None = None) -> int:
    """The ``sslkit`` command: ``sslkit <command> [key=value ...]``, one of :data:`COMMANDS`."""
    args = sys.argv[1:] if argv is None else argv
    if argv is None:
        from sslkit.console import guard_streams

        guard_streams()
    if args and args[0] in COMMANDS:
        from sslkit.launch.runtime import run_entry

        return run_entry(lambda: _command(args[0])(args[1:]))
    lines = "\n".join(f"  {name:8s} {what}" for name, what in COMMANDS.items())
    text = f"usage: sslkit <command> [key=value ...]\n\ncommands:\n{lines}\n\nsslkit <command> --help says more."
    if args and args[0] not in ("-h", "--help"):
        from sslkit.errors import did_you_mean

        print(f"sslkit: unknown command '{args[0]}'.{did_you_mean(args[0], list(COMMANDS))}\n\n{text}",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    _print(text)
    return 0 if args else EXIT_BAD_INPUT
