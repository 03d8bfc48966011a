"""BatchNorm with statistics over the global batch on any device (CPU / gloo included)."""

from __future__ import annotations

import torch
from torch import nn

from sslkit.distributed import all_reduce_sum_with_grad, is_distributed

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    r"""BatchNorm whose training statistics are those of the global batch: all ranks together.

    It mirrors the semantics of :class:`torch.nn.SyncBatchNorm` (biased variance to normalise,
    unbiased variance of the global batch in ``running_var``, ``momentum`` or, with
    ``momentum=None``, the cumulative average; no sync in eval mode) with plain tensor operations
    and one collective of :mod:`sslkit.distributed`, so it runs wherever those run, CPU processes
    on gloo included (torch's fused version accepts only GPU-like tensors).

    For an input ``[N, C, *]`` (any rank >= 2: BatchNorm1d ``[N, C]`` / ``[N, C, L]``, 2d, 3d),
    rank ``r`` computes per channel its count ``n_r`` (samples x spatial positions), mean ``m_r``
    and sum of squared deviations ``M2_r``, then all-reduces (sum) the float64 vector
    ``[n_r * m_r, M2_r + n_r * m_r**2, n_r]`` of ``2C + 1`` values:

    .. math::

        N = \sum_r n_r, \quad \mu = \frac{S_1}{N}, \quad M_2 = S_2 - N\mu^2, \quad
        \sigma^2 = \frac{M_2}{N}, \quad y = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}}\,\gamma + \beta

    (float64, so the cancellation in ``S_2 - N mu^2`` costs nothing that matters), and
    ``running_var`` moves towards ``M_2 / (N - 1)``; the running statistics are identical on every
    rank. The all-reduce carries gradient (:func:`sslkit.distributed.all_reduce_sum_with_grad`):
    the gradient reaching a rank's input is that of the sum of every rank's loss through the
    shared statistics, so DDP's averaging of the parameter gradients gives the answer of one
    process with the concatenated batch.

    The statistics are computed in float32 (float64 for float64 input) with autocast off; the
    output has the input's dtype and, through broadcasting, its memory format (channels_last
    stays channels_last). In eval mode, without a process group or with one process it is plain
    BatchNorm (:func:`torch.nn.functional.batch_norm`). Parameter and buffer names are those of
    ``nn.BatchNorm*d``, so state dicts are interchangeable. The default (world) process group is
    used; every rank must run every forward (and backward) of the layer in the same order.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input [N, C, *] (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` ``[N, C, *]`` with global-batch statistics when training on several ranks."""
        self._check_input_dim(input)
        if not (self.training and is_distributed()):
            return super().forward(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels in dim 1, got input of shape {tuple(input.shape)}")
        return self._synced_forward(input)

    def _synced_forward(self, input: torch.Tensor) -> torch.Tensor:
        c = input.shape[1]
        dims = [0, *range(2, input.dim())]
        n_local = input.numel() // c if c else 0  # from the shape: no host-device sync
        compute = torch.float64 if input.dtype == torch.float64 else torch.float32
        shape = [1, c] + [1] * (input.dim() - 2)
        with torch.autocast(input.device.type, enabled=False):
            x = input.to(compute)
            if n_local > 0:
                var_local, mean_local = torch.var_mean(x, dim=dims, correction=0)
            else:  # an empty shard contributes nothing
                var_local = mean_local = x.new_zeros(c)
            mean64, var64 = mean_local.double(), var_local.double()
            count = torch.full((1,), float(n_local), dtype=torch.float64, device=input.device)
            # [n m, M2 + n m^2, n] with M2 = n var
            local = torch.cat([mean64 * n_local, (var64 + mean64 * mean64) * n_local, count])
            total = all_reduce_sum_with_grad(local)
            s1, s2, n = total[:c], total[c : 2 * c], total[2 * c :]
            mean = s1 / n
            m2 = (s2 - s1 * mean).clamp_min(0.0)
            invstd = torch.rsqrt(m2 / n + self.eps)

            tracked = self.num_batches_tracked
            if self.track_running_stats and tracked is not None:
                with torch.no_grad():
                    tracked.add_(1)
                    if self.momentum is None:  # cumulative moving average, as a tensor (no .item())
                        factor: float | torch.Tensor = 1.0 / tracked.double()
                    else:
                        factor = self.momentum
                    unbiased = m2 / (n - 1).clamp_min(1.0)
                    for buf, value in ((self.running_mean, mean), (self.running_var, unbiased)):
                        buf.copy_((buf.double() * (1 - factor) + value * factor).to(buf.dtype))

            scale = invstd.to(compute)
            if self.weight is not None:
                scale = scale * self.weight.to(compute)
            y = (x - mean.to(compute).view(shape)) * scale.view(shape)
            if self.bias is not None:
                y = y + self.bias.to(compute).view(shape)
        return y.to(input.dtype)


def _convert(module: nn.Module) -> nn.Module:
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats)
        if module.affine:  # the same Parameter objects: requires_grad, device, dtype, references kept
            out.weight = module.weight
            out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _convert(child))
    return out


def convert_sync_batchnorm(module: nn.Module, device: torch.device | str) -> nn.Module:
    """``module`` with every BatchNorm layer replaced by one that uses global-batch statistics.

    On a CUDA ``device`` this is :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm` (the fused
    NCCL kernels). On any other device each ``nn.modules.batchnorm._BatchNorm`` (BatchNorm1d/2d/3d,
    affine or not, with or without running statistics) becomes a :class:`SyncBatchNorm` that shares
    its parameters and buffers (so ``requires_grad``, device and dtype are kept) and its
    train/eval flag: with one process the converted model computes exactly what it did before.
    Returns the converted module (a new object when ``module`` itself is a BatchNorm layer).
    """
    if torch.device(device).type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _convert(module)
