"""standard_train_step: sample -> forward -> loss -> all-reduce -> backward -> update, with hooks."""

from __future__ import annotations

import contextlib

import torch

from sslkit.distributed import all_reduce_mean
from sslkit.hooks.base import Event
from sslkit.optim import set_lr, set_weight_decay
from sslkit.registry import register_train_step
from sslkit.task import LastBatch, SSLTask
from sslkit.train_steps.sample import to_sample

__all__ = ["standard_train_step"]


def _split_loss(out: torch.Tensor | dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A loss returns a scalar, or a dict whose ``loss`` entry is optimised and the rest logged."""
    if isinstance(out, dict):
        if "loss" not in out:
            raise KeyError(f"a loss that returns a dict must have a 'loss' key; it has {sorted(out)}")
        return out["loss"], {k: v.detach() for k, v in out.items() if k != "loss"}
    return out, {}


@register_train_step("standard")
def standard_train_step(task: SSLTask) -> None:
    """One step of DESIGN.md's flow. Raises StopIteration when the phase's data runs out.

    No host-device synchronisation happens here: the loss is accumulated on the device and
    read by the logging hook at its interval.
    """
    timer = task.perf_stats.timer
    train = task.train
    with timer("read_sample"):
        batch = next(task.data_iterator)
        sample = to_sample(batch, task.device, task.channels_last)
    task.last_batch = LastBatch(sample=sample)

    grad_ctx = torch.enable_grad() if train else torch.no_grad()
    amp_ctx = (
        torch.autocast(task.device.type, dtype=task.amp_dtype)
        if task.amp_dtype is not None
        else contextlib.nullcontext()
    )
    with grad_ctx:
        with amp_ctx:
            with timer("forward"):
                output = task.model(sample["input"])
            task.last_batch.model_output = output
            task.run_hooks(Event.ON_FORWARD)
            with timer("loss"):
                loss, terms = _split_loss(task.loss(output, sample))
        task.last_batch.loss = loss
        task.last_batch.metrics.update(terms)
        with timer("loss_all_reduce"):
            reduced = all_reduce_mean(loss.detach().float())
        task.last_batch.reduced_loss = reduced
        with timer("meters"):
            task.loss_sum += reduced
            task.loss_count += 1
        task.run_hooks(Event.ON_LOSS_AND_METER)

        if not train:
            return
        with timer("backward"):
            task.optimizer.zero_grad(set_to_none=True)
            if task.scaler is not None:
                task.scaler.scale(loss).backward()
            else:
                loss.backward()
        task.run_hooks(Event.ON_BACKWARD)
        with timer("optimizer_step"):
            set_lr(task.optimizer, task.lr_schedule(task.where))
            if task.wd_schedule is not None:
                set_weight_decay(task.optimizer, task.wd_schedule(task.where))
            if task.scaler is not None:
                task.scaler.step(task.optimizer)
                task.scaler.update()
            else:
                task.optimizer.step()
        task.run_hooks(Event.ON_UPDATE)
        task.iteration += 1
        task.num_updates += task.global_batch_size
