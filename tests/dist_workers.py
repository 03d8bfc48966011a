"""Functions that run inside spawned gloo worker processes for the multi-process tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import forkrun
import torch
import torch.distributed as dist
from helpers import mlp
from torch import nn

from sslkit.checkpoint import Checkpointer
from sslkit.distributed import find_free_port, start_processes


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, f"{out}.{rank}")
    finally:
        if dist.is_initialized():  # (sslkit's CLI shuts the group down itself)
            dist.destroy_process_group()


def recorded_steps(out: Path | str) -> dict[int, list[int]]:
    """Every step's dataset indices over all ranks and micro-batches (sorted), from the ``record_samples`` hook's
    files (tests/reliability/sslkit_faults.py) in the run folder ``out``."""
    steps: dict[int, list[int]] = {}
    for path in Path(out).glob("samples.*.txt"):
        for line in path.read_text().split("\n"):
            if line:
                iteration, _micro, *indices = (int(v) for v in line.split())
                steps.setdefault(iteration, []).extend(indices)
    return {k: sorted(v) for k, v in steps.items()}


def elastic_steps(args: list[str], tmp: Path) -> tuple[dict[int, list[int]], dict[int, dict[int, list[int]]]]:
    """The elastic-resume experiment of the sharded sources' tests: ``args`` (a run of 2 epochs of 4 steps, a
    checkpoint every 3, ``imports=[sslkit_faults]``) on 2 processes uninterrupted, and crashed after step 5 then
    resumed on 1 and on 4 processes; the steps' samples of the uninterrupted run and of each resumed one (by world)."""
    import shutil

    from sslkit.launch.cli import main

    hooks = "hooks=[{name: record_samples}, {name: fault_crash, step: %d}]"
    ref, crashed = tmp / "ref", tmp / "crashed"
    assert run_ranks(cli_main, 2, str(tmp / "r"), [*args, hooks % 10**6, f"output_dir={ref}"]) == ["0", "0"]
    results = run_ranks(cli_main, 2, str(tmp / "c"), [*args, hooks % 5, f"output_dir={crashed}"])
    assert all("injected crash after step 5" in r for r in results), results
    resumed = {}
    for world in (1, 4):
        out = tmp / f"on{world}"
        shutil.copytree(crashed, out)
        for path in out.glob("samples.*.txt"):
            path.unlink()  # keep only what the resumed run reads
        argv = [*args, hooks % 5, f"output_dir={out}"]
        assert (main(argv) == 0 if world == 1 else
                run_ranks(cli_main, world, str(tmp / f"w{world}"), argv) == ["0"] * world)
        resumed[world] = recorded_steps(out)
    return recorded_steps(ref), resumed


def assert_resumed_as_uninterrupted(expected: dict[int, list[int]], resumed: dict[int, dict[int, list[int]]],
                                    samples: int = 128) -> None:
    """:func:`elastic_steps`'s outcome as it must be: the uninterrupted run's first epoch (steps 0-3) reads each of
    ``samples`` once, and every resumed run (on 1 and on 4 processes) runs steps 3-7 (from the checkpoint at 3)
    on exactly the uninterrupted run's samples, step for step."""
    assert sorted(i for step in range(4) for i in expected[step]) == list(range(samples))
    for world, got in resumed.items():
        assert sorted(got) == [3, 4, 5, 6, 7], world
        assert all(got[s] == expected[s] for s in got), world


def run_ranks(fn: Callable[..., Any], world: int, out: str, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; return each rank's result."""
    forkrun.ensure_server()  # (sslkit's own fork server, started as a run's: with its malloc thresholds)
    start_processes(_entry, (world, find_free_port(), fn, args, out), world)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def two_view_data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)


def loss_and_grads_on_shard(rank: int, world: int, loss_name: str, n: int) -> dict[str, Any]:
    """DDP model, this rank's slice of the global batch, the named loss; its loss and grads."""
    import sslkit.methods  # noqa: F401
    from sslkit.distributed import all_reduce_mean
    from sslkit.registry import LOSSES

    model = nn.parallel.DistributedDataParallel(mlp())
    x1, x2 = two_view_data(n)
    b = n // world
    sl = slice(rank * b, (rank + 1) * b)
    loss_fn = LOSSES.get(loss_name)()
    out = loss_fn({"projections": [model(x1[sl]), model(x2[sl])]}, {})
    loss = out["loss"] if isinstance(out, dict) else out
    loss.backward()
    return {"loss": all_reduce_mean(loss.detach()), "grads": [p.grad.clone() for p in model.parameters()]}


def train_steps(rank: int, world: int, manual: bool, steps: int, accumulate: int = 1) -> dict[str, torch.Tensor]:
    """A few real standard_train_step calls on a DDP-wrapped SSLModel with a per-sample loss."""
    from helpers import per_sample_task

    task = per_sample_task(rank, world, manual=manual, accumulate=accumulate, steps=steps)
    from sslkit.train_steps.standard import standard_train_step
    from sslkit.trainer import train

    train(task, standard_train_step)
    return {k: v.clone() for k, v in task.base_model.state_dict().items()}


def diverging_ranks(rank: int, world: int) -> None:
    """Rank 1 nudges a weight after step 2; the consistency check must stop both ranks at step 2."""
    from helpers import per_sample_task

    from sslkit.hooks.base import SSLHook
    from sslkit.hooks.consistency import ConsistencyCheckHook
    from sslkit.train_steps.standard import standard_train_step
    from sslkit.trainer import train

    class Nudge(SSLHook):
        def on_update(self, task) -> None:
            if task.rank == 1 and task.clock.step == 1:  # the second optimizer step
                with torch.no_grad():
                    next(task.base_model.parameters()).add_(1e-3)

    task = per_sample_task(rank, world, steps=4)
    task.hooks = [Nudge(), ConsistencyCheckHook(every_n_steps=1)]
    train(task, standard_train_step)


def mocov3_loss_and_grads(rank: int, world: int, n: int) -> dict[str, Any]:
    """MoCo v3 without BatchNorm on this rank's slice of an ``n``-sample two-view batch.

    DDP-wrapped when a process group is up; with ``world=1`` and none, the one-process reference.
    The teacher is moved off the student (seeded) so the keys are not the student's projections.
    Returns the loss and acc averaged over ranks and the (DDP-averaged) gradients of the student.
    """
    import sslkit.methods  # noqa: F401
    from sslkit.distributed import all_reduce_mean, is_distributed
    from sslkit.methods.moco import MoCoV3Loss, build_mocov3
    from sslkit.models.heads import MLPHead

    # no BatchNorm anywhere: mlp() trunk, a BN-free projector, a one-layer (Linear) predictor
    model = build_mocov3(mlp(), MLPHead(6, 8, 4, batch_norm=False), predictor_num_layers=1)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for p in [*model.teacher_trunk.parameters(), *model.teacher_head.parameters()]:
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    net = nn.parallel.DistributedDataParallel(model) if is_distributed() else model
    x1, x2 = two_view_data(n)
    b = n // world
    sl = slice(rank * b, (rank + 1) * b)
    out = MoCoV3Loss(temperature=0.2)(net([x1[sl], x2[sl]]), {})
    out["loss"].backward()
    student = [p for p in model.parameters() if p.requires_grad]
    return {"loss": all_reduce_mean(out["loss"].detach()), "acc": all_reduce_mean(out["acc"].detach()),
            "grads": [p.grad.clone() for p in student]}


#: Variants of a recipe's small test form, named ``recipe-variant``: KoLeo off (dinov3, on timm's DINOv3 trunk with
#: LayerScale 1e-5: KoLeo's nearest neighbours among the near-identical CLS features of such a model at the start are
#: decided by rounding, docs/vit.md).
VARIANTS = {"nokoleo": ["loss.koleo_weight=0"],
            # two students on one teacher: a CNN with BatchNorm and a ViT
            "two": ["distill.students=[small_cnn, {trunk: vit_tiny, name: vit, trunk_kwargs: {patch_size: 8, depth: 1, "
                    "num_heads: 2}}]"],
            "vit": ["distill.students=[{trunk: vit_tiny, name: vit, trunk_kwargs: {patch_size: "
                    "8, depth: 1, num_heads: 2}}]"],
            # a high-resolution phase from the second update, with the Gram teacher's crops (test_dinov3.py)
            "hires": ["loss.koleo_weight=0", "hires.start_step=1", "hires.global_sizes=[40,48]",
                      "hires.local_sizes=[16,24]", "hires.teacher_sizes=[64,72]", "hires.ratios=[0.5,0.5]"]}


def recipe_states(rank: int, world: int, recipes: list[str], per_rank_batch: int, steps: int,
                  out: str, *extra: str) -> dict[str, dict[str, torch.Tensor]]:
    """Train each recipe (its small test form, tests/helpers.py, and ``extra`` overrides) for ``steps`` updates on
    this rank's share of a global batch of ``per_rank_batch * world``; the model's and loss's state after them, per
    recipe. BatchNorm layers are synced (distributed.sync_bn) so that any number of ranks computes what one
    process does."""
    from helpers import RECIPES, SMALL

    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config
    from sslkit.train_steps.standard import standard_train_step
    from sslkit.trainer import train

    states = {}
    for name in recipes:
        recipe, _, variant = name.partition("-")
        cfg = compose_config([f"config={recipe}", *SMALL, *RECIPES[recipe], *VARIANTS.get(variant, []),
                              f"data.batch_size={per_rank_batch}",
                              f"optim.max_steps={steps}", "distributed.sync_bn=true", "eval.knn.enabled=false",
                              "log.tensorboard=false", "log.report=false", "checkpoint.every_n_epochs=0",
                              "optim.warmup_epochs=0", *extra, f"output_dir={out}/{name}-{world}"])
        os.makedirs(cfg.output_dir, exist_ok=True)
        task = build_task(cfg)
        try:
            train(task, standard_train_step)
        finally:
            task.close()
        from sslkit.parallel import is_sharded

        # under fsdp the whole model is gathered onto rank 0 (the others get an empty dict)
        whole = (Checkpointer.state(task, gather_rng=False)["model"] if is_sharded(task.model)
                 else task.base_model.state_dict())
        state = {f"model.{k}": v.detach().clone() for k, v in whole.items()}
        state.update({f"loss.{k}": v.detach().clone() for k, v in task.loss.state_dict().items()})
        states[name] = state
    return states


def distill_teacher_shards(rank: int, world: int, out: str) -> dict[str, Any]:
    """The small distillation with a ViT student under fsdp: whether the teacher's trunk is sharded, the teacher's
    elements this rank holds and in all, and its pooled features of one fixed batch (whole on every rank)."""
    from helpers import RECIPES, SMALL

    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config
    from sslkit.parallel import is_sharded

    cfg = compose_config(["config=distill", *SMALL, *RECIPES["distill"], *VARIANTS["vit"], "optim.max_steps=1",
                          "distributed.strategy=fsdp", "eval.knn.enabled=false", "log.tensorboard=false",
                          "log.report=false", f"output_dir={out}/teacher-{world}"])
    os.makedirs(cfg.output_dir, exist_ok=True)
    task = build_task(cfg)
    try:
        teacher = task.base_model.teacher
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in teacher.parameters())
        x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        pooled, _ = teacher.encode([x], dense=True)
        return {"sharded": is_sharded(teacher.trunk), "local": local,
                "total": sum(p.numel() for p in teacher.parameters()), "pooled": pooled[0].detach().clone()}
    finally:
        task.close()


def dinov2_parts_on_shard(rank: int, world: int, n: int) -> dict[str, Any]:
    """Sinkhorn-Knopp, KoLeo (with its gradient) and the global max on this rank's shard of one fixed batch."""
    from sslkit.distributed import all_reduce_max
    from sslkit.methods.dinov2_parts import koleo_loss
    from sslkit.methods.sinkhorn import sinkhorn_knopp

    g = torch.Generator().manual_seed(3)
    logits, x = torch.randn(n, 12, generator=g) * 3, torch.randn(n, 5, generator=g)
    shard = slice(rank * n // world, (rank + 1) * n // world)
    mine = x[shard].clone().requires_grad_(True)
    loss = koleo_loss(mine)
    loss.backward()
    return {"q": sinkhorn_knopp(logits[shard], 0.1, iterations=3), "koleo": loss.detach(), "grad": mine.grad,
            "max": all_reduce_max(logits[shard].max())}


def strategy_runs(rank: int, world: int, cases: dict[str, list[str]], strategy: str, steps: int,
                  out: str) -> dict[str, dict[str, Any]]:
    """:func:`strategy_run` for each case (``name`` or ``recipe-variant``: its extra overrides), in one group."""
    return {case: strategy_run(rank, world, case.split("-")[0], strategy, steps, f"{out}/{case}", *extra)
            for case, extra in cases.items()}


def strategy_run(rank: int, world: int, recipe: str, strategy: str, steps: int, out: str,
                 *extra: str) -> dict[str, Any]:
    """Train ``recipe`` (its small test form) for ``steps`` updates under ``distributed.strategy=strategy``: this
    rank's loss at every micro-batch, the whole model state after them (rank 0; gathered under fsdp), and, under
    fsdp, how the parameters were sharded (each teacher parameter's placements and local shape against its
    student's)."""
    from helpers import RECIPES, SMALL

    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config
    from sslkit.hooks.base import SSLHook
    from sslkit.train_steps.standard import standard_train_step
    from sslkit.trainer import train

    losses: list[torch.Tensor] = []

    class Record(SSLHook):
        def on_loss_and_meter(self, task: Any) -> None:
            losses.append(task.last_batch.loss.detach().clone())

    cfg = compose_config([f"config={recipe}", *SMALL, *RECIPES[recipe], f"optim.max_steps={steps}",
                          "eval.knn.enabled=false", "log.tensorboard=false", "checkpoint.every_n_epochs=0",
                          f"distributed.strategy={strategy}", *extra, f"output_dir={out}/{recipe}-{strategy}"])
    os.makedirs(cfg.output_dir, exist_ok=True)
    task = build_task(cfg)
    task.hooks.append(Record())
    layout = []
    from torch.distributed.tensor import DTensor

    model = task.base_model
    pairs = [*model.momentum_pairs(), *[(model.trunk, copy) for copy in model.trunk_copies()]]  # + a Gram teacher
    for student, teacher in pairs:
        for s, t in zip(student.parameters(), teacher.parameters(), strict=True):
            layout.append((isinstance(t, DTensor), isinstance(s, DTensor),
                           tuple(t.placements) == tuple(s.placements) if isinstance(t, DTensor) else None,
                           tuple(t.to_local().shape) == tuple(s.to_local().shape) if isinstance(t, DTensor) else None))
    try:
        train(task, standard_train_step)
    finally:
        task.close()
    state = Checkpointer.state(task)
    return {"losses": torch.stack(losses), "model": state["model"], "layout": layout,
            "sharded": sum(isinstance(p, DTensor) for p in task.model.parameters()),
            "dtypes": {p.dtype for p in task.model.parameters()},
            "params": sum(1 for _ in task.model.parameters())}


def cli_main(rank: int, world: int, argv: list[str]) -> str:
    """``sslkit.launch.cli.main(argv)`` on this rank of an initialised gloo group: its exit code, or the error it
    raised."""
    from sslkit.launch.cli import main

    try:
        return str(main(list(argv)))
    except Exception as exc:  # a crash a test injected
        return f"{type(exc).__name__}: {exc}"
