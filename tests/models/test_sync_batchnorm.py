"""The synced BatchNorm on one process: plain BatchNorm's results, state dicts and conversion of nested layers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sslkit.models.sync_batchnorm as sbn
from sslkit.distributed import all_reduce_sum_with_grad
from sslkit.models.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

CASES = [  # (layer, input shape, kwargs)
    (nn.BatchNorm1d, (6, 4), {}),
    (nn.BatchNorm1d, (6, 4, 5), {}),
    (nn.BatchNorm2d, (5, 3, 4, 4), {}),
    (nn.BatchNorm3d, (3, 2, 3, 3, 2), {}),
    (nn.BatchNorm2d, (5, 3, 4, 4), {"affine": False}),
    (nn.BatchNorm2d, (5, 3, 4, 4), {"momentum": None}),
    (nn.BatchNorm1d, (6, 4), {"track_running_stats": False}),
]


def _plain(layer: type[nn.Module], shape: tuple[int, ...], kwargs: dict) -> nn.Module:
    torch.manual_seed(0)
    bn = layer(shape[1], **kwargs)
    if bn.affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return bn


def _run(bn: nn.Module, shape: tuple[int, ...], steps: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Forwards and backwards in train mode, then one eval forward; outputs and every gradient."""
    g = torch.Generator().manual_seed(1)
    outs, grads = [], []
    bn.train()
    for _ in range(steps):
        x = (torch.randn(shape, generator=g) * 2 + 1).requires_grad_(True)
        y = bn(x)
        (y * torch.randn(shape, generator=g)).sum().backward()
        outs.append(y.detach())
        grads.append(x.grad)
    bn.eval()
    outs.append(bn(torch.randn(shape, generator=g)))
    grads += [p.grad for p in bn.parameters()]
    return outs, grads


@pytest.mark.parametrize(("layer", "shape", "kwargs"), CASES)
def test_without_process_group_equals_plain_batchnorm(layer, shape, kwargs) -> None:
    plain = _plain(layer, shape, kwargs)
    synced = convert_sync_batchnorm(copy.deepcopy(plain), torch.device("cpu"))
    assert type(synced) is SyncBatchNorm
    assert list(synced.state_dict()) == list(plain.state_dict())
    outs, grads = _run(plain, shape)
    outs_s, grads_s = _run(synced, shape)
    for a, b in zip(outs + grads, outs_s + grads_s):
        assert torch.equal(a, b)
    for key, value in plain.state_dict().items():
        assert torch.equal(synced.state_dict()[key], value), key


@pytest.mark.parametrize(("layer", "shape", "kwargs"), CASES)
def test_synced_math_with_one_rank_equals_plain_batchnorm(layer, shape, kwargs, monkeypatch) -> None:
    """The global-statistics path itself (forced on, with the all-reduce of one rank: identity)."""
    monkeypatch.setattr(sbn, "is_distributed", lambda: True)
    monkeypatch.setattr(sbn, "all_reduce_sum_with_grad", lambda t: t)
    plain = _plain(layer, shape, kwargs)
    synced = convert_sync_batchnorm(copy.deepcopy(plain), "cpu")
    outs, grads = _run(plain, shape)
    outs_s, grads_s = _run(synced, shape)
    for a, b in zip(outs + grads, outs_s + grads_s):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    for key, value in plain.state_dict().items():
        assert torch.allclose(synced.state_dict()[key], value, atol=1e-6, rtol=1e-6), key


def test_synced_path_keeps_dtype_and_channels_last_under_bf16_autocast(monkeypatch) -> None:
    monkeypatch.setattr(sbn, "is_distributed", lambda: True)
    monkeypatch.setattr(sbn, "all_reduce_sum_with_grad", lambda t: t)
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
    synced = convert_sync_batchnorm(copy.deepcopy(bn), "cpu")
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = conv(x)
        y, y_ref = synced(h), bn(h)
    assert h.dtype == y.dtype == torch.bfloat16
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(y.float(), y_ref.float(), atol=2e-2)
    assert torch.allclose(synced.running_var, bn.running_var, atol=1e-3)


def test_state_dicts_are_interchangeable_with_plain_batchnorm() -> None:
    plain = _plain(nn.BatchNorm2d, (4, 3, 2, 2), {})
    _run(plain, (4, 3, 2, 2))
    synced = SyncBatchNorm(3)
    synced.load_state_dict(plain.state_dict())
    back = nn.BatchNorm2d(3)
    back.load_state_dict(synced.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(back.state_dict()[key], value)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                   nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4, affine=False)))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64, 6), nn.BatchNorm1d(6))
        self.teacher = copy.deepcopy(self.head)  # a frozen copy, as SSLModel's momentum teacher
        for p in self.teacher.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x).flatten(1)
        return self.head(h) + self.teacher(h)


def test_convert_replaces_nested_batchnorms_and_keeps_flags() -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    model.trunk[1].eval()
    x = torch.randn(5, 3, 8, 8)
    expected = copy.deepcopy(model)(x)
    params = {name: p for name, p in model.named_parameters()}
    converted = convert_sync_batchnorm(model, torch.device("cpu"))
    bns = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(bns) == 4 and all(type(m) is SyncBatchNorm for m in bns)
    assert not converted.trunk[1].training and converted.trunk[3][1].training
    assert converted.trunk[3][1].weight is None
    assert all(not p.requires_grad for p in converted.teacher.parameters())
    assert all(p.requires_grad for p in converted.head.parameters())
    for name, p in converted.named_parameters():  # the same Parameter objects (an optimizer keeps working)
        assert p is params[name]
    assert torch.equal(converted(x), expected)


def test_convert_on_cuda_device_uses_torch_sync_batchnorm() -> None:
    converted = convert_sync_batchnorm(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)), "cuda")
    assert type(converted[1]) is nn.SyncBatchNorm


def test_input_of_rank_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 2D"):
        SyncBatchNorm(3)(torch.randn(3))


def test_all_reduce_sum_with_grad_without_process_group_is_identity() -> None:
    x = torch.randn(4, requires_grad=True)
    assert all_reduce_sum_with_grad(x) is x


def test_functional_fallback_is_batch_norm() -> None:
    """Eval mode uses the running statistics, exactly as F.batch_norm does."""
    bn = _plain(nn.BatchNorm2d, (2, 3, 2, 2), {})
    synced = convert_sync_batchnorm(copy.deepcopy(bn), "cpu").eval()
    x = torch.randn(2, 3, 2, 2)
    ref = F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.1, bn.eps)
    assert torch.equal(synced(x), ref)
