"""Models and worker functions for the synced-BatchNorm tests (spawned gloo ranks import them from here)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sslkit.distributed import all_reduce_mean, all_reduce_sum, is_distributed
from sslkit.models.sync_batchnorm import convert_sync_batchnorm


class BNNet(nn.Module):
    """conv + BatchNorm2d + ReLU + pool, then linear + BatchNorm1d + ReLU + linear: BN in trunk and head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                                   nn.AvgPool2d(2), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(36, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


class SeqNet(nn.Module):
    """BatchNorm1d on ``[N, C, L]`` without affine parameters and with the cumulative average (momentum None)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv1d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm1d(6, affine=False, momentum=None)
        self.out = nn.Linear(6 * 5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.conv(x))).flatten(1))


def images(n: int, seed: int = 1) -> torch.Tensor:
    """``n`` random 3x6x6 images."""
    return torch.randn(n, 3, 6, 6, generator=torch.Generator().manual_seed(seed))


def per_sample_loss(out: torch.Tensor, denominator: int) -> torch.Tensor:
    """Sum over the samples of a per-sample term, divided by ``denominator``: decomposes over samples."""
    target = torch.linspace(-1.0, 1.0, out.shape[1])
    return (out - target).pow(2).sum() / denominator


def train_bn(rank: int, world: int, sync: bool, steps: int, batch: int) -> dict[str, Any]:
    """``steps`` SGD (momentum) steps of a DDP-wrapped :class:`BNNet` on this rank's ``batch`` of every
    global batch of ``world * batch`` images (one process without a process group: the whole batch).
    ``sync`` converts the BatchNorms with :func:`convert_sync_batchnorm`. Returns the loss of every
    step (averaged over ranks) and the final state dict."""
    model: nn.Module = BNNet()
    if sync:
        model = convert_sync_batchnorm(model, torch.device("cpu"))
    net = nn.parallel.DistributedDataParallel(model) if is_distributed() else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = images(steps * world * batch).view(steps, world * batch, 3, 6, 6)
    losses = []
    for step in range(steps):
        x = data[step, rank * batch : (rank + 1) * batch]
        loss = per_sample_loss(net(x), batch)  # mean over the local batch
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(all_reduce_mean(loss.detach()))
    return {"losses": torch.stack(losses), "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _case(rank: int, make: type[nn.Module], x_all: torch.Tensor, sizes: list[int],
          memory_format: torch.memory_format = torch.contiguous_format) -> dict[str, Any]:
    """Forward and backward of this rank's slice (``sizes`` per rank) of ``x_all`` through a converted model."""
    model = convert_sync_batchnorm(make(), "cpu")
    lo = sum(sizes[:rank])
    x = x_all[lo : lo + sizes[rank]].clone().contiguous(memory_format=memory_format).requires_grad_(True)
    out = model(x)
    per_sample_loss(out, x_all.shape[0]).backward()  # this rank's share of the mean over the global batch
    grads = [all_reduce_sum(p.grad) for p in model.parameters()]  # sum over ranks: the global gradient
    result = {"out": out.detach(), "x_grad": x.grad, "grads": grads,
              "buffers": {k: v.clone() for k, v in model.named_buffers()}}
    if isinstance(model, BNNet):  # the memory format of the BatchNorm2d output (one more synced forward)
        with torch.no_grad():
            result["bn_out_channels_last"] = model.trunk[1](model.trunk[0](x)).is_contiguous(
                memory_format=torch.channels_last)
    return result


def gradient_cases(rank: int, world: int) -> dict[str, Any]:
    """Several single forward / backward cases on ranks holding (possibly unequal) shards of one batch.

    ``world=1`` without a process group is the one-process reference. Returns, per case, this rank's
    outputs and input gradient, the parameter gradients summed over ranks and the BN buffers.
    """
    torch.manual_seed(5)
    images_8 = images(8, seed=3)
    seq_8 = torch.randn(8, 3, 5, generator=torch.Generator().manual_seed(4))
    cases: dict[str, Any] = {}
    full = [8] if world == 1 else None
    cases["cnn_equal"] = _case(rank, BNNet, images_8, full or [4, 4])
    cases["cnn_unequal"] = _case(rank, BNNet, images_8, full or [3, 5])
    cases["cnn_channels_last"] = _case(rank, BNNet, images_8, full or [4, 4], torch.channels_last)
    cases["seq_cumulative"] = _case(rank, SeqNet, seq_8, full or [4, 4])
    # bf16 autocast: the output keeps the input's dtype, statistics in float32
    model = convert_sync_batchnorm(BNNet(), "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feats = model.trunk[0](images_8[rank * 4 : (rank + 1) * 4] if world > 1 else images_8)
        out = model.trunk[1](feats)
        cases["bf16"] = {"in_dtype": feats.dtype, "out_dtype": out.dtype, "out": out.float().detach()}
    return cases
