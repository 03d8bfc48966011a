"""With sync_bn, 2 gloo ranks with batch B train a BatchNorm model like 1 process with batch 2B; without, not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from dist_workers import run_ranks
from helpers import SMALL, run_cli

if str(Path(__file__).parent) not in sys.path:  # spawned ranks import the workers by module name
    sys.path.insert(0, str(Path(__file__).parent))
from sync_bn_workers import gradient_cases, train_bn

pytestmark = pytest.mark.multiprocess


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def test_synced_batchnorm_two_ranks_train_like_one_process(tmp_path) -> None:
    """conv + BatchNorm2d + linear + BatchNorm1d, DDP, SGD with momentum, 3 steps, B = 4 per rank.

    Measured (torch 2.15, CPU): synced vs 1 process 2.4e-7 on the losses and 2.2e-7 on parameters and
    running statistics; plain BatchNorm on 2 ranks vs 1 process 0.26 on the losses, 0.38 on the state.
    """
    steps, batch = 3, 4
    single = train_bn(0, 1, False, steps, 2 * batch)
    synced = run_ranks(train_bn, 2, str(tmp_path / "sync"), True, steps, batch)
    plain = run_ranks(train_bn, 2, str(tmp_path / "plain"), False, steps, batch)
    assert set(synced[0]["state"]) == set(single["state"])  # the converted model's state dict is a plain one
    for rank in range(2):
        assert _max_diff(synced[rank]["state"], synced[0]["state"]) == 0.0  # identical on every rank
        assert torch.allclose(synced[rank]["losses"], single["losses"], atol=1e-6)
        for key, value in single["state"].items():
            assert torch.allclose(synced[rank]["state"][key].double(), value.double(), atol=1e-6), key
    # the contrast: each rank normalising its own batch is far from the one-process run
    assert (plain[0]["losses"] - single["losses"]).abs().max() > 1e-3
    assert _max_diff(plain[0]["state"], single["state"]) > 1e-3


def test_input_and_parameter_gradients_match_one_process(tmp_path) -> None:
    """One forward / backward: each rank's input gradient is its slice of the 1-process input gradient,
    the parameter gradients summed over ranks are the 1-process ones; also unequal shards (3 + 5),
    channels_last, BatchNorm1d on [N, C, L] without affine and momentum None, and bf16 autocast."""
    single = gradient_cases(0, 1)
    ranks = run_ranks(gradient_cases, 2, str(tmp_path / "grads"))
    for name, ref in single.items():
        if name == "bf16":
            continue
        assert ranks[0][name]["buffers"].keys() == ref["buffers"].keys()
        for key, value in ref["buffers"].items():
            assert torch.equal(ranks[0][name]["buffers"][key], ranks[1][name]["buffers"][key])
            assert torch.allclose(ranks[0][name]["buffers"][key].double(), value.double(), atol=1e-6), (name, key)
        out = torch.cat([r[name]["out"] for r in ranks])
        x_grad = torch.cat([r[name]["x_grad"] for r in ranks])
        assert torch.allclose(out, ref["out"], atol=1e-6), (name, (out - ref["out"]).abs().max())
        assert torch.allclose(x_grad, ref["x_grad"], atol=1e-7, rtol=1e-5), (name, (x_grad - ref["x_grad"]).abs().max())
        for g, g_ref in zip(ranks[0][name]["grads"], ref["grads"]):
            assert torch.allclose(g, g_ref, atol=1e-6, rtol=1e-5), (name, (g - g_ref).abs().max())
    assert [r["cnn_unequal"]["out"].shape[0] for r in ranks] == [3, 5]
    assert all(r["cnn_channels_last"]["bn_out_channels_last"] for r in ranks)
    for r in ranks:
        assert r["bf16"]["in_dtype"] == r["bf16"]["out_dtype"] == torch.bfloat16
    bf16 = torch.cat([r["bf16"]["out"] for r in ranks])
    assert torch.allclose(bf16, single["bf16"]["out"], atol=3e-2)


@pytest.mark.slow
def test_cli_two_cpu_processes_with_sync_bn(tmp_path) -> None:
    proc = run_cli("config=simclr", *SMALL, "machine.device=cpu", "distributed.nproc_per_node=2",
                   "distributed.sync_bn=true", "optim.max_steps=2", "eval.knn.enabled=false",
                   f"output_dir={tmp_path / 'run'}")
    assert "step 2/2" in proc.stdout
