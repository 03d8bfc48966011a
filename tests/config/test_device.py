"""Device choices stop at config time with a message that says what to change, and nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sslkit.config.machine as compose
from sslkit.builder import resolve_num_workers, set_determinism
from sslkit.config.compose import compose_config
from sslkit.config.schema import ConfigError
from sslkit.launch.cli import main


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """Pretend this machine has ``n`` visible GPUs (0: none)."""
    def set_count(n: int) -> None:
        monkeypatch.setattr(compose, "_cuda_available", lambda: n > 0)
        monkeypatch.setattr(compose, "_cuda_device_count", lambda: n)
    return set_count


def test_cuda_without_a_usable_gpu_names_the_fix(gpus, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    gpus(0)
    with pytest.raises(ConfigError, match=r"'machine.device' = cuda: .*Or set machine.device=cpu"):
        compose_config(["machine.device=cuda"])
    out = tmp_path / "run"
    assert main(["machine.device=cuda", f"output_dir={out}"]) == 2
    assert "config error" in capsys.readouterr().err
    assert not out.exists()  # nothing written


def test_more_processes_than_gpus_is_refused_before_nccl(gpus, tmp_path: Path) -> None:
    gpus(1)
    for device in ("auto", "cuda"):
        with pytest.raises(ConfigError, match=r"'distributed.nproc_per_node' = 2: .* 1 is visible .* Set "
                                              r"distributed.nproc_per_node=1, or machine.device=cpu to run 2 CPU"):
            compose_config([f"machine.device={device}", "distributed.nproc_per_node=2"])
    out = tmp_path / "run"
    assert main(["distributed.nproc_per_node=2", f"output_dir={out}"]) == 2
    assert not out.exists()
    # the CPU with gloo is always possible, and one process per GPU is fine
    assert compose_config(["machine.device=cpu", "distributed.nproc_per_node=2"]).distributed.nproc_per_node == 2
    gpus(2)
    assert compose_config(["distributed.nproc_per_node=2"]).machine.device == "auto"


def test_torchrun_processes_are_counted_too(gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"'torchrun --nproc_per_node' = 2"):
        compose_config(["data.limit=512"])


def test_a_named_gpu_must_exist_and_serve_one_process(gpus) -> None:
    gpus(2)
    with pytest.raises(ConfigError, match=r"'machine.device' = cuda:3: this machine has 2 GPU\(s\), cuda:0 to cuda:1"):
        compose_config(["machine.device=cuda:3"])
    with pytest.raises(ConfigError, match=r"cuda:1 names one GPU, but 2 processes each need their own"):
        compose_config(["machine.device=cuda:1", "distributed.nproc_per_node=2"])
    assert compose_config(["machine.device=cuda:1"]).machine.device == "cuda:1"


def test_nccl_on_the_cpu_is_refused(gpus) -> None:
    gpus(0)
    with pytest.raises(ConfigError, match=r"'distributed.backend' = nccl needs GPUs"):
        compose_config(["machine.device=cpu", "distributed.backend=nccl"])


def test_num_workers_and_pin_memory_values_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"'data.num_workers' must be auto or an integer >= 0, got 'many'"):
        compose_config(["data.num_workers=many"])
    with pytest.raises(ConfigError, match=r"'data.pin_memory' must be auto, true or false"):
        compose_config(["data.pin_memory=yes"])
    assert compose_config(["data.num_workers=3"]).data.num_workers == 3


@pytest.mark.parametrize(("cores", "procs", "device", "expected"), [
    (16, 1, "cuda", 15),  # the H100 box of issue #10: 15 workers fed it (77 s wall)
    (16, 2, "cuda", 7),
    (2, 1, "cpu", 1),
    (16, 1, "cpu", 8),
    (1, 1, "cuda", 1),
])
def test_auto_num_workers_follows_the_cores_per_process(monkeypatch: pytest.MonkeyPatch, cores: int, procs: int,
                                                        device: str, expected: int) -> None:
    import sslkit.builder.runtime as runtime

    monkeypatch.setattr(runtime, "_cores", lambda: cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(procs))
    workers, why = resolve_num_workers("auto", torch.device(device))
    assert workers == expected and why.startswith("auto")
    assert resolve_num_workers(5, torch.device(device)) == (5, "data.num_workers")


def test_cpu_runs_do_not_pin_memory_and_keep_train_workers(tmp_path: Path) -> None:
    from helpers import SMALL

    from sslkit.builder import build_task

    task = build_task(compose_config(["config=simclr", *SMALL, "data.num_workers=1", "data.pin_memory=auto",
                                      f"output_dir={tmp_path}"]))
    train = task.loaders["train"]
    assert train.pin_memory is False and train.persistent_workers is True
    knn = next(h for h in task.hooks if h.name == "knn")
    assert knn.train_loader.persistent_workers is False  # used once at the end: no processes held all run


def test_deterministic_mode_switches_torch_and_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        set_determinism(True, torch.device("cuda"))
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert compose.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        set_determinism(False, torch.device("cuda"))
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    finally:
        set_determinism(False, torch.device("cpu"))
    assert not torch.backends.cudnn.benchmark
