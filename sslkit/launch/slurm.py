"""launcher=slurm: submit a training run as a SLURM job through submitit; a pre-empted job checkpoints and requeues.

``python tools/run.py config=dino launcher=slurm slurm.nodes=2 slurm.gpus_per_node=8`` composes and checks the
config on the login node, submits one job of ``nodes x tasks_per_node`` tasks (one per GPU) with submitit, prints
the job id and where its logs go, and returns. In the job, every task runs the same command as one rank of the
run (rank, world size and the master address come from SLURM through submitit's ``JobEnvironment``).

Pre-emption and time limits: SLURM sends SIGUSR2 ``slurm.signal_delay_s`` seconds before it stops the job
(``--signal=USR2@N``, which submitit sets). sslkit takes SIGUSR2 as a pre-emption signal on every rank: the ranks
finish their step, write a checkpoint and stop; rank 0 then requeues the job (``scontrol requeue``), which starts
again from that checkpoint, up to ``slurm.max_requeues`` times. SIGTERM (``scancel``) also checkpoints, but does
not requeue: a cancelled job stays cancelled.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sslkit.errors import UserError

__all__ = ["SlurmTask", "in_slurm_task", "submit"]

logger = logging.getLogger("sslkit")

#: Set in a job's tasks: the command runs as a rank of the run there, instead of submitting again.
TASK_ENV = "SSLKIT_SLURM_TASK"


def in_slurm_task() -> bool:
    """True inside a task of a job that ``launcher=slurm`` submitted."""
    return os.environ.get(TASK_ENV) == "1"


def _submitit() -> Any:
    try:
        import submitit
    except ImportError:
        raise UserError("launcher=slurm submits through submitit, which is not installed: pip install 'sslkit[slurm]' "
                        "(or pip install submitit) on the machine you submit from, or use launcher=local") from None
    return submitit


def _tasks_per_node(s: DictConfig) -> int:
    return int(s.tasks_per_node or s.gpus_per_node or 1)


def executor(cfg: DictConfig) -> Any:
    """A submitit executor for ``cfg.slurm`` whose logs go to ``<output_dir>/slurm/<job id>/``."""
    submitit = _submitit()
    if shutil.which("sbatch") is None:
        raise UserError("launcher=slurm needs SLURM's sbatch, which is not on this machine's PATH: submit from a "
                        "cluster's login node (where sbatch works), or use launcher=local to train here")
    s = cfg.slurm
    folder = os.path.join(os.path.abspath(cfg.output_dir), "slurm", "%j")
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    params: dict[str, Any] = {
        "name": s.job_name or os.path.basename(os.path.normpath(cfg.output_dir)),
        "nodes": int(s.nodes), "tasks_per_node": _tasks_per_node(s), "cpus_per_task": int(s.cpus_per_task),
        "timeout_min": int(s.time_min), "slurm_signal_delay_s": int(s.signal_delay_s),
    }
    if s.gpus_per_node:
        params["gpus_per_node"] = int(s.gpus_per_node)
    if s.mem_gb:
        params["mem_gb"] = int(s.mem_gb)
    for key in ("partition", "account", "qos", "constraint"):
        if s[key]:
            params[f"slurm_{key}"] = str(s[key])
    if s.setup:
        params["slurm_setup"] = [str(line) for line in s.setup]
    if s.additional:
        params["slurm_additional_parameters"] = OmegaConf.to_container(s.additional, resolve=True)
    ex.update_parameters(**params)
    return ex


def submit(cfg: DictConfig, argv: list[str], entry: Callable[[list[str]], int]) -> int:
    """Submit the run ``argv`` describes as a SLURM job whose tasks run ``entry(argv)`` (the CLI's ``main``); print
    its id and log paths. Returns the exit code (0). A command that gives credentials on its line
    (``data.storage_options``' secrets) is refused: submitit writes the command into the run folder."""
    from sslkit.config.secrets import redact_overrides

    if redact_overrides(list(argv)) != list(argv):
        raise UserError("launcher=slurm writes the command into the run folder (submitit's job file), and this one "
                        "gives credentials in data.storage_options: set them in the job's environment instead "
                        "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS), "
                        "which s3fs and gcsfs read, and keep only plain options (endpoint_url, anon, ...) on the line")
    ex = executor(cfg)
    try:
        job = ex.submit(SlurmTask(list(argv), int(cfg.slurm.max_requeues), entry))
    except Exception as exc:  # sbatch refused it (a partition, an account, a limit): its own words
        raise UserError(f"sbatch refused the job: {str(exc).strip()[-800:]}") from None
    s = cfg.slurm
    print(f"sslkit: submitted SLURM job {job.job_id}: {s.nodes} node(s) x {_tasks_per_node(s)} task(s), "
          f"{s.time_min} min; run folder {cfg.output_dir}\n"
          f"  logs: {job.paths.stdout} (task 0; the others: {job.paths.stdout.parent}/)\n"
          f"  errors: {job.paths.stderr}\n"
          f"  follow: tail -f {job.paths.stdout}   cancel: scancel {job.job_id}\n"
          "  a pre-empted or timed-out job checkpoints and requeues itself (SIGUSR2 "
          f"{s.signal_delay_s} s before the end; at most {s.max_requeues} times)")
    sys.stdout.flush()
    return 0


class SlurmTask:
    """What each task of the job runs: the run's command (``entry(argv)``, the CLI's ``main``, pickled by reference)
    as one rank of it; after a SIGUSR2 stop, rank 0 requeues the job."""

    def __init__(self, argv: list[str], max_requeues: int, entry: Callable[[list[str]], int]) -> None:
        self.argv = argv
        self.max_requeues = max_requeues
        self.entry = entry

    def __call__(self) -> int:
        import submitit

        from sslkit.errors import PREEMPTED_EXIT_CODE
        from sslkit.reliability import last_stop_signal

        env = submitit.JobEnvironment()
        tasks_per_node = env.num_tasks // max(env.num_nodes, 1)
        os.environ.update({
            TASK_ENV: "1", "RANK": str(env.global_rank), "LOCAL_RANK": str(env.local_rank),
            "WORLD_SIZE": str(env.num_tasks), "LOCAL_WORLD_SIZE": str(tasks_per_node),
            "MASTER_ADDR": env.hostnames[0], "MASTER_PORT": str(master_port(env.job_id)),
        })
        code = self.entry(self.argv)
        if code == PREEMPTED_EXIT_CODE and last_stop_signal() == "SIGUSR2" and env.global_rank == 0:
            self.requeue(env.job_id)
        if code not in (0, PREEMPTED_EXIT_CODE):
            raise SystemExit(code)
        return code

    def requeue(self, job_id: str) -> None:
        """Put the job back in the queue (it resumes from the checkpoint just written), unless it was requeued
        ``max_requeues`` times already."""
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        if restarts >= self.max_requeues:
            print(f"sslkit: not requeued: job {job_id} was requeued {restarts} time(s), slurm.max_requeues="
                  f"{self.max_requeues}; submit the same command again to resume", file=sys.stderr, flush=True)
            return
        print(f"sslkit: requeueing job {job_id} (requeue {restarts + 1} of at most {self.max_requeues}); it resumes "
              "from the checkpoint just written", flush=True)
        subprocess.run(["scontrol", "requeue", str(job_id)], check=False, timeout=60)


def master_port(job_id: str) -> int:
    """A port for the job's rendezvous, the same in every task: from the job id, in 20000-39999."""
    digits = "".join(c for c in str(job_id) if c.isdigit()) or "0"
    return 20000 + int(digits) % 20000
