"""Two gloo ranks give the answer of one process: gather with gradient, DDP vs manual reduction, accumulation."""

from __future__ import annotations

import pytest
import torch
from dist_workers import loss_and_grads_on_shard, mlp, run_ranks, train_steps, two_view_data
from helpers import per_sample_task

import sslkit.methods  # noqa: F401
from sslkit.registry import LOSSES
from sslkit.train_steps.standard import standard_train_step
from sslkit.trainer import train

pytestmark = pytest.mark.multiprocess


def one_process_reference(loss_name: str, n: int) -> dict:
    model = mlp()
    x1, x2 = two_view_data(n)
    out = LOSSES.get(loss_name)()({"projections": [model(x1), model(x2)]}, {})
    loss = out["loss"] if isinstance(out, dict) else out
    loss.backward()
    return {"loss": loss.detach(), "grads": [p.grad for p in model.parameters()]}


@pytest.mark.parametrize("loss_name", ["nt_xent", "barlow_twins", "vicreg", "lejepa"])
def test_two_ranks_batch_b_equal_one_process_batch_2b(loss_name: str, tmp_path) -> None:
    n = 12
    ref = one_process_reference(loss_name, n)
    results = run_ranks(loss_and_grads_on_shard, 2, str(tmp_path / "out"), loss_name, n)
    for res in results:
        assert torch.allclose(res["loss"], ref["loss"], atol=1e-6)
        for g, g_ref in zip(res["grads"], ref["grads"]):
            assert torch.allclose(g, g_ref, atol=1e-6), (g - g_ref).abs().max()


def test_ddp_and_manual_reduction_give_identical_weights_on_all_ranks(tmp_path) -> None:
    ddp = run_ranks(train_steps, 2, str(tmp_path / "ddp"), False, 3)
    manual = run_ranks(train_steps, 2, str(tmp_path / "manual"), True, 3)
    single = per_sample_task(steps=3)
    train(single, standard_train_step)
    for key, value in single.base_model.state_dict().items():
        for rank in range(2):
            assert torch.equal(ddp[rank][key], ddp[0][key]) and torch.equal(manual[rank][key], manual[0][key])
        # two ranks: (a + b) / 2 and a / 2 + b / 2 are the same floats, so DDP == manual bit for bit
        assert torch.equal(ddp[0][key], manual[0][key])
        assert torch.allclose(ddp[0][key], value, atol=1e-6)


def test_accumulation_equals_one_big_step_single_process() -> None:
    big = per_sample_task(steps=3, accumulate=1)
    acc = per_sample_task(steps=3, accumulate=2)
    train(big, standard_train_step)
    train(acc, standard_train_step)
    assert acc.clock.step == big.clock.step == 3
    for key, value in big.base_model.state_dict().items():
        assert torch.allclose(acc.base_model.state_dict()[key], value, atol=1e-6)


def test_accumulation_with_ddp_no_sync_equals_one_process(tmp_path) -> None:
    acc = run_ranks(train_steps, 2, str(tmp_path / "acc"), False, 3, 2)
    single = per_sample_task(steps=3)
    train(single, standard_train_step)
    for key, value in single.base_model.state_dict().items():
        assert torch.equal(acc[0][key], acc[1][key])
        assert torch.allclose(acc[0][key], value, atol=1e-6)


def test_consistency_check_stops_diverged_ranks_naming_the_step(tmp_path) -> None:
    from dist_workers import diverging_ranks
    from torch.multiprocessing import ProcessRaisedException

    with pytest.raises(ProcessRaisedException, match=r"step 2: the parameters of rank\(s\) \[1\] differ"):
        run_ranks(diverging_ranks, 2, str(tmp_path / "div"))
