"""standard_train_step: sample -> forward -> loss -> all-reduce -> backward -> update, with hooks."""

from __future__ import annotations

import contextlib

import torch

from sslkit.distributed import agree_any, all_reduce_gradients, all_reduce_mean
from sslkit.hooks.base import Event
from sslkit.optim import set_lr, set_weight_decay
from sslkit.registry import register_train_step
from sslkit.reliability import OutOfMemoryHalt, drop_update, snapshot_buffers
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


def _sync_context(task: SSLTask, last_micro_batch: bool) -> contextlib.AbstractContextManager[None]:
    """DDP's ``no_sync`` when its reduction must not run after this backward: under manual
    gradient reduction, and on every micro-batch but the last when accumulating."""
    no_sync = getattr(task.model, "no_sync", None)
    if no_sync is not None and (task.manual_gradient_reduction or not last_micro_batch):
        return no_sync()
    return contextlib.nullcontext()


@register_train_step("standard")
def standard_train_step(task: SSLTask) -> None:
    """One step of DESIGN.md's flow. Raises StopIteration when the phase's data runs out.

    With ``task.accumulate_steps = K`` (train phases) it runs K micro-batches, each forward
    followed by ``backward(loss / K)``, DDP reduction only after the last, then one optimizer
    step; ``on_forward`` and ``on_loss_and_meter`` fire per micro-batch, ``on_backward`` and
    ``on_update`` once. No host-device synchronisation happens here: the loss is accumulated on
    the device and read by the logging hook at its interval.

    Reliability (docs/reliability.md): an out-of-memory error in the forward or backward raises
    :class:`OutOfMemoryHalt` (``task.oom_policy == "halt"``) or drops the step's update on every
    rank (``"skip"``); a hook may also drop the update by setting ``task.skip_update`` in
    ``on_backward``. A dropped step still counts as an iteration (the schedules move on) but not
    in ``num_updates``, and with ``task.snapshot_buffers`` the buffers its forward changed are
    restored.
    """
    timer = task.perf_stats.timer
    train = task.train
    micro_batches = task.batches_per_step
    grad_ctx = torch.enable_grad() if train else torch.no_grad()
    amp_ctx = (
        torch.autocast(task.device.type, dtype=task.amp_dtype)
        if task.amp_dtype is not None
        else contextlib.nullcontext()
    )
    snapshot = snapshot_buffers(task) if train and task.snapshot_buffers else None
    out_of_memory = False
    for micro in range(micro_batches):
        try:
            with timer("read_sample"):
                batch = next(task.data_iterator)
                sample = to_sample(batch, task.device, task.channels_last)
            task.last_batch = LastBatch(sample=sample)
            with grad_ctx, _sync_context(task, micro == micro_batches - 1):
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
                    continue
                with timer("backward"):
                    if micro == 0:
                        task.optimizer.zero_grad(set_to_none=True)
                    scaled = loss / micro_batches if micro_batches > 1 else loss
                    if task.scaler is not None:
                        task.scaler.scale(scaled).backward()
                    else:
                        scaled.backward()
        except torch.OutOfMemoryError as exc:
            if not train or task.oom_policy != "skip":
                raise OutOfMemoryHalt(
                    f"step {task.iteration + 1}: out of memory in the forward or backward pass ({exc}). "
                    "Lower data.batch_size (optim.accumulate_steps keeps the global batch), enable amp, or "
                    "set reliability.oom=skip to drop such steps. Running the same command resumes from the "
                    "last checkpoint."
                ) from exc
            out_of_memory = True
            for _ in range(micro + 1, micro_batches):  # consume the step's other micro-batches, so the
                next(task.data_iterator)              # data position stays what a resume computes
            break
    if not train:
        return
    if out_of_memory:  # free what the failed pass held before anything else allocates
        task.last_batch = LastBatch(sample={})
        task.optimizer.zero_grad(set_to_none=True)
        if task.device.type == "cuda":
            torch.cuda.empty_cache()
    if task.oom_policy == "skip" and task.world_size > 1:
        (out_of_memory,) = agree_any(out_of_memory)  # every rank skips the same step
    if out_of_memory:
        task.skip_update = "out of memory"
    else:
        if task.manual_gradient_reduction:
            with timer("gradient_all_reduce"):
                all_reduce_gradients(task.base_model.parameters(), task.bucket_cap_mb)
        task.run_hooks(Event.ON_BACKWARD)
    if task.skip_update is not None:
        drop_update(task, snapshot)
        task.iteration += 1
        return
    task.consecutive_skips = 0
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
