"""The named stages of a train step: sample, forward and loss, reduce, backward, update; a step composes them.

The standard step is::

    batch = run_micro_batches(task, forward_backward)  # K x (sample -> forward+loss -> reduce -> backward)
    update(task, batch)                                # the guard's decision, lr / wd, optimizer step, clock

and a custom step reuses any of them and replaces the others (docs/train_steps.md). The stages pass the
micro-batch's data on (:class:`~sslkit.task.MicroBatch`: the sample, the model's output, the loss, the logged
metrics); ``task.last_batch`` is the same record published for the hooks, never read back here. Whatever a custom
step reuses keeps its part of the contract: :func:`run_micro_batches` gives gradient accumulation (``no_sync`` on
all but the last micro-batch, ``loss / K``), the grad mode of the phase, the manual gradient reduction and the
update guard's reports (each loss, an out of memory, the ranks' agreement); :func:`forward_and_loss` the precision
policy and the step context; :func:`reduce` the all-reduced, metered loss; :func:`backward` the GradScaler;
:func:`update` the guard's decision, every schedule, the scaler's step and the clock. The guard is asked nowhere
else in a step. Each stage runs under its timer (the table at phase end) and none syncs the host with the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from sslkit.distributed import all_reduce_gradients, all_reduce_mean
from sslkit.events import Event
from sslkit.optim import set_lr, set_weight_decay
from sslkit.parallel import full_tensor, gradient_sync, is_sharded
from sslkit.task import MicroBatch, SSLTask
from sslkit.train_steps.sample import augment_on_device, prepare_sample

__all__ = [
    "augment_on_device",
    "backward",
    "clip_gradients",
    "forward_and_loss",
    "forward_backward",
    "model_keywords",
    "precision",
    "prepare_sample",
    "read_sample",
    "reduce",
    "run_micro_batches",
    "split_loss",
    "unscale_gradients",
    "update",
]


def split_loss(out: torch.Tensor | dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A loss returns a scalar, or a dict whose ``loss`` entry is optimised and the rest logged (detached)."""
    if isinstance(out, dict):
        if "loss" not in out:
            raise KeyError(f"a loss that returns a dict must have a 'loss' key; it has {sorted(out)}")
        return out["loss"], {k: v.detach() for k, v in out.items() if k != "loss"}
    return out, {}


def precision(task: SSLTask) -> contextlib.AbstractContextManager[None]:
    """The precision policy: ``torch.autocast`` to ``task.amp_dtype`` on the task's device, or nothing."""
    if task.amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(task.device.type, dtype=task.amp_dtype)


def read_sample(task: SSLTask) -> dict[str, Any]:
    """Stage *sample*: the next sample of the phase (:func:`~sslkit.train_steps.sample.phase_samples`, chosen when
    it started: in train phases prepared one ahead, the copy to the device, the decode and the augmentation of the
    next batch queued on a side CUDA stream while this one's step runs). Raises ``StopIteration`` when the phase's
    data runs out (the trainer ends the phase), and ``RuntimeError`` when a train step reads other than one batch
    per micro-batch (its augmentations would not be those a resume computes)."""
    with task.perf_stats.timer("read_sample"):
        sample = next(task.data_iterator)
    read = getattr(task.data_iterator, "position", None)
    if task.train and read is not None and read - 1 != _position(task):
        raise RuntimeError(f"the train batches were read out of step: the clock is at micro-batch {_position(task)} "
                           f"of the epoch and the batch read is number {read - 1}; a custom step must read its "
                           "batches with read_sample (or next(task.data_iterator)) once per micro-batch")
    return sample


def _position(task: SSLTask) -> int:
    """The micro-batch of the epoch the clock is at: the batch that ``read_sample`` reads now."""
    clock = task.clock
    return clock.step_in_epoch * clock.micro_batches + clock.micro_batch


def model_keywords(sample: dict[str, Any]) -> dict[str, Any]:
    """What the model takes besides the views, where the sample has it: ``masks`` (the mask stage's) and
    ``teacher_views`` (crops only a teacher sees: a Gram teacher's high-resolution crops, ``teacher_input``)."""
    keywords = {}
    if sample.get("masks") is not None:
        keywords["masks"] = sample["masks"]
    if sample.get("teacher_input") is not None:
        keywords["teacher_views"] = sample["teacher_input"]
    return keywords


def forward_and_loss(task: SSLTask, sample: dict[str, Any]) -> MicroBatch:
    """Stage *forward and loss*, under the precision policy: the model's output (``on_forward`` fires), then
    the loss with the step context. Returns the micro-batch (also ``task.last_batch``, for the hooks): its
    ``loss`` is this rank's, attached to the graph; the logged terms of a loss that returns a dict are in its
    ``metrics``."""
    batch = MicroBatch(sample=sample)
    task.last_batch = batch
    timer = task.perf_stats.timer
    with precision(task):
        with timer("forward"):
            batch.model_output = task.model(sample["input"], **model_keywords(sample))
        task.run_hooks(Event.ON_FORWARD)
        with timer("loss"):
            batch.loss, terms = split_loss(task.loss(batch.model_output, sample, task.context()))
    batch.metrics.update(terms)
    return batch


def reduce(task: SSLTask, batch: MicroBatch) -> torch.Tensor:
    """Stage *reduce*: ``batch``'s loss averaged over ranks (detached, kept as its ``reduced_loss``) and added to
    the device-side meter; ``on_loss_and_meter`` fires. Returns the reduced loss."""
    if batch.loss is None:
        raise ValueError("reduce takes the micro-batch forward_and_loss returned, with its loss")
    with task.perf_stats.timer("loss_all_reduce"):
        batch.reduced_loss = all_reduce_mean(batch.loss.detach().float())
    with task.perf_stats.timer("meters"):
        task.loss_sum += batch.reduced_loss
        task.loss_count += 1
    task.run_hooks(Event.ON_LOSS_AND_METER)
    return batch.reduced_loss


def backward(task: SSLTask, batch: MicroBatch) -> None:
    """Stage *backward* (train phases): gradients of ``batch``'s ``loss / K`` (K micro-batches per update) added to
    those of the step's earlier micro-batches, through the GradScaler with float16."""
    if batch.loss is None:
        raise ValueError("backward takes the micro-batch forward_and_loss returned, with its loss")
    clock = task.clock
    with task.perf_stats.timer("backward"):
        if clock.micro_batch == 0:
            task.optimizer.zero_grad(set_to_none=True)
        scaled = batch.loss / clock.micro_batches if clock.micro_batches > 1 else batch.loss
        if task.scaler is not None:
            task.scaler.scale(scaled).backward()
        else:
            scaled.backward()


def forward_backward(task: SSLTask) -> MicroBatch:
    """One micro-batch of the standard step: sample -> forward and loss -> reduce -> backward (train phases)."""
    batch = forward_and_loss(task, read_sample(task))
    reduce(task, batch)
    if task.train:
        backward(task, batch)
    return batch


def _sync_context(task: SSLTask, last_micro_batch: bool) -> contextlib.AbstractContextManager[None]:
    """DDP's ``no_sync`` (FSDP2's ``set_requires_gradient_sync(False)``) when its reduction must not run after this
    backward: under manual gradient reduction, and on every micro-batch but the last when accumulating."""
    if is_sharded(task.model):
        return gradient_sync(task.model, last_micro_batch)
    no_sync = getattr(task.model, "no_sync", None)
    if no_sync is not None and (task.manual_gradient_reduction or not last_micro_batch):
        return no_sync()
    return contextlib.nullcontext()


def run_micro_batches(task: SSLTask, body: Callable[[SSLTask], MicroBatch] = forward_backward) -> MicroBatch:
    """Run ``body`` once per micro-batch of this step (``optim.micro_batches`` in train phases, else once),
    each under the phase's grad mode and, but for the last, DDP's ``no_sync``; ``task.clock.micro_batch`` says
    which. Returns the last micro-batch (what ``body`` returned: :func:`forward_and_loss`'s record).

    The update guard's reports of a train step are all here: the step begins, each micro-batch's reduced loss is
    reported (whether it is finite, recorded on the device), an out-of-memory error is reported (the guard halts,
    or :func:`update` drops the step on every rank; the step's remaining micro-batches are then read and dropped,
    so the data position stays what a resume computes), and the ranks agree whether any ran out of memory. Train
    phases end with the manual gradient reduction (when configured) and ``on_backward``, unless the step ran out
    of memory."""
    clock = task.clock
    train = task.train
    guard = task.guard
    if train:
        guard.begin_step(task)
    grad = torch.enable_grad if train else torch.no_grad
    out_of_memory = False
    batch: MicroBatch | None = None
    for micro in range(clock.micro_batches):
        clock.micro_batch = micro
        try:
            with grad(), _sync_context(task, micro == clock.micro_batches - 1):
                batch = body(task)
        except torch.OutOfMemoryError as exc:
            guard.report_oom(task, exc)
            out_of_memory = True
            for _ in range(micro + 1, clock.micro_batches):
                next(task.data_iterator)
            break
        if not isinstance(batch, MicroBatch):
            raise TypeError(f"a micro-batch body returns the MicroBatch that forward_and_loss made (got "
                            f"{type(batch).__name__}): end it with 'return batch' (docs/train_steps.md)")
        if train and batch.reduced_loss is not None:
            guard.report_loss(task, batch.reduced_loss, batch.metrics, batch.sample)
    clock.micro_batch = 0
    if out_of_memory:  # free what the failed pass held before anything else allocates (and before agreeing)
        batch = task.last_batch = MicroBatch(sample={})
        task.optimizer.zero_grad(set_to_none=True)
        if task.device.type == "cuda":
            torch.cuda.empty_cache()
    assert batch is not None
    if not train or guard.out_of_memory(task):  # on every rank: any rank out of memory drops the step everywhere
        return batch
    if task.manual_gradient_reduction:
        with task.perf_stats.timer("gradient_all_reduce"):
            all_reduce_gradients(task.base_model.parameters(), task.bucket_cap_mb)
    task.run_hooks(Event.ON_BACKWARD)
    return batch


def unscale_gradients(task: SSLTask, batch: MicroBatch) -> None:
    """Divide the gradients by the GradScaler's scale now (float16), so that a custom step can clip or inspect
    true gradients before :func:`update`; ``batch`` (the step's last micro-batch) records it. Nothing to do
    without a scaler."""
    if task.scaler is None or batch.unscaled:
        return
    if any(p.grad is not None for group in task.optimizer.param_groups for p in group["params"]):
        task.scaler.unscale_(task.optimizer)  # (a step that ran out of memory has no gradients to unscale)
        batch.unscaled = True


def clip_gradients(task: SSLTask, batch: MicroBatch) -> torch.Tensor:
    """Clip the gradients to ``task.clip_grad`` and log the norm they had (``grad_norm`` in ``batch``'s metrics,
    on the device; ``batch``: the step's last micro-batch).

    Runs in :func:`update` just before the optimizer step: after the step's last micro-batch (the accumulated
    gradients), after the gradient reduction and ``on_backward`` (a parameter whose gradient a hook dropped
    is left out), and after unscaling under float16 (:func:`unscale_gradients`). ``global`` mode scales
    every gradient by ``min(1, clip / total norm)`` (``torch.nn.utils.clip_grad_norm_``: fairseq, MAE,
    DINOv2); ``per_parameter`` scales each parameter's gradient by ``min(1, clip / (its norm + 1e-6))``
    (DINO's ``utils.clip_gradients``). The logged norm is the global one before clipping, either way. No
    host-device synchronisation. With several students (optimizer groups with an ``owner``) each student's
    gradients are clipped by their own norm (as separate optimizers would), each logged as ``grad_norm_<name>``."""
    unscale_gradients(task, batch)
    owners: dict[str, list[torch.nn.Parameter]] = {}
    for group in task.optimizer.param_groups:
        owners.setdefault(str(group.get("owner", "")), []).extend(p for p in group["params"] if p.grad is not None)
    clip = task.clip_grad
    with task.perf_stats.timer("clip_grad"):
        norms = {owner: _clip(params, clip, task.clip_grad_mode, is_sharded(task.model))
                 for owner, params in owners.items() if params}
        if not norms:
            return torch.zeros((), device=task.device)
        total = next(iter(norms.values())) if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(list(
            norms.values())))
    batch.metrics["grad_norm"] = total.detach()
    if len(norms) > 1:  # several students: each one's norm, each clipped alone
        batch.metrics.update({f"grad_norm_{owner.rsplit('.', 1)[-1]}": n.detach() for owner, n in norms.items()})
    return total


def _clip(params: list[torch.nn.Parameter], clip: float, mode: str, sharded: bool) -> torch.Tensor:
    """Clip the gradients of ``params`` (one owner's) as :func:`clip_gradients` says; their norm before it."""
    grads = [p.grad for p in params]
    if mode == "per_parameter":
        norms = [full_tensor(n) for n in torch._foreach_norm(grads)]  # sharded: each norm over all shards
        total = torch.linalg.vector_norm(torch.stack(norms))
        factors = [(clip / (n + 1e-6)).clamp(max=1.0) for n in norms]
        if sharded:
            for g, f in zip(grads, factors, strict=True):
                g.mul_(f)
        else:
            torch._foreach_mul_(grads, factors)
        return total
    # the norm over every rank's shards under fsdp (a DTensor made whole), the plain norm otherwise
    total = full_tensor(torch.nn.utils.get_total_norm(grads, foreach=True))
    torch.nn.utils.clip_grads_with_norm_(params, clip, total, foreach=True)
    return total


def update(task: SSLTask, batch: MicroBatch) -> None:
    """Stage *update* (train phases; nothing in eval phases): ask the update guard, then either drop the update
    or set the lr and weight decay at the clock (recorded for the log), step the optimizer (through
    the GradScaler), fire ``on_update``; the clock moves on either way. ``batch``: the step's last micro-batch
    (:func:`run_micro_batches` returns it), which receives the gradient norm."""
    if not task.train:
        return
    clock = task.clock
    reason = task.guard.decide(task)
    if reason is not None:
        if task.scaler is not None and batch.unscaled:
            task.scaler.update()  # close the scaler's step that unscale_ opened (it backs off on an inf)
        task.guard.drop(task, reason)  # raises once too many in a row were dropped
        clock.step += 1
        return
    task.guard.applied()
    if task.clip_grad > 0:
        clip_gradients(task, batch)
    with task.perf_stats.timer("optimizer_step"):
        lr = task.lr_schedule.at(clock)
        set_lr(task.optimizer, lr)
        task.scheduled["lr"] = lr
        if task.wd_schedule is not None:
            wd = task.wd_schedule.at(clock)
            set_weight_decay(task.optimizer, wd)
            task.scheduled["weight_decay"] = wd
        if task.scaler is not None:
            task.scaler.step(task.optimizer)
            task.scaler.update()
        else:
            task.optimizer.step()
    task.run_hooks(Event.ON_UPDATE)
    clock.step += 1
    clock.samples += task.global_batch_size
