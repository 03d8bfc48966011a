"""The named stages of a train step: sample, forward and loss, reduce, backward, update; a step composes them.

The standard step is::

    run_micro_batches(task, forward_backward)   # K x (sample -> forward+loss -> reduce -> backward), on_backward
    update(task)                                # the guard's decision, lr / wd, optimizer step, on_update, clock

and a custom step reuses any of them and replaces the others (docs/train_steps.md). Whatever it
reuses keeps its part of the contract: :func:`run_micro_batches` gives gradient accumulation
(``no_sync`` on all but the last micro-batch, ``loss / K``), the grad mode of the phase, the
out-of-memory report to the update guard and the manual gradient reduction;
:func:`forward_and_loss` the precision policy and the step context; :func:`reduce` the
all-reduced, metered loss and its non-finite check; :func:`backward` the GradScaler;
:func:`update` the guard's veto, every schedule, the scaler's step and the clock. Each stage
runs under its timer (the table at phase end) and none syncs the host with the device.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from sslkit.data.device_augment import Images
from sslkit.data.device_decode import DeviceDecoder, RawImages
from sslkit.data.prefetch import Prefetcher
from sslkit.distributed import all_reduce_gradients, all_reduce_mean
from sslkit.events import Event
from sslkit.optim import set_lr, set_weight_decay
from sslkit.parallel import full_tensor, gradient_sync, is_sharded
from sslkit.task import LastBatch, SSLTask
from sslkit.train_steps.sample import to_sample

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


#: Images of many sizes that the workers decoded: copied to the device and packed (no JPEG to decode).
_PACK_ONLY = DeviceDecoder(channels=3)


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
    """Stage *sample*: the next batch as the model's sample dict on the device; starts ``task.last_batch``.

    In train phases the batches come through a :class:`~sslkit.data.prefetch.Prefetcher`: the copy to the
    device, the decode and the augmentation (``data.augment_on=device``) of the next batch are queued on a
    side CUDA stream while this one's step runs (on the CPU one batch ahead, in line). Raises
    ``StopIteration`` when the phase's data runs out (the trainer ends the phase)."""
    if not task.train:
        with task.perf_stats.timer("read_sample"):
            sample = to_sample(next(task.data_iterator), task.device, task.channels_last)
        task.last_batch = LastBatch(sample=sample)
        return sample
    position = _position(task)
    if not isinstance(task.data_iterator, Prefetcher):  # the phase's first batch
        # a weak reference: the task holds the prefetcher, which must not hold the task (a cycle would keep the
        # loader's iterator, and its worker processes, alive until a garbage collection)
        prepare = functools.partial(prepare_sample, weakref.proxy(task))
        task.data_iterator = Prefetcher(task.data_iterator, prepare, task.device, start=position)
    with task.perf_stats.timer("read_sample"):
        sample = next(task.data_iterator)
    if task.data_iterator.position - 1 != position:
        raise RuntimeError(f"the train batches were read out of step: the clock is at micro-batch {position} of "
                           f"the epoch and the batch read is number {task.data_iterator.position - 1}; a custom "
                           "step must read its batches with read_sample (or next(task.data_iterator)) once per "
                           "micro-batch")
    task.last_batch = LastBatch(sample=sample)
    return sample


def _position(task: SSLTask) -> int:
    """The micro-batch of the epoch the clock is at: the batch that ``read_sample`` reads now."""
    clock = task.clock
    return clock.step_in_epoch * clock.micro_batches + clock.micro_batch


def prepare_sample(task: SSLTask, batch: dict[str, Any]) -> dict[str, Any]:
    """A train batch made the model's sample: copied to the device (non-blocking from pinned memory) and, with
    ``data.augment_on=device``, decoded and augmented there (each sample brings its own uniforms); with
    ``masking``, each view's masks drawn there too (``sample["masks"]``: from every sample's seed, epoch and
    index, :class:`~sslkit.models.masking.MaskPlan`)."""
    device_side = task.device_augment is not None
    sample = to_sample(batch, task.device, task.channels_last and not device_side)
    if device_side:
        images, uniforms = sample["input"]
        if isinstance(images, RawImages):  # images of many sizes, JPEGs as bytes
            with task.perf_stats.timer("decode"):
                decoder = task.device_decoder or _PACK_ONLY
                images = decoder(images, sample, task.device)
        with task.perf_stats.timer("augment"):
            sample["input"] = augment_on_device(task, images, uniforms)
    if task.masking is not None:
        with task.perf_stats.timer("mask"):
            sample["masks"] = task.masking(sample["input"], sample["data_idx"], task.epoch)
    return sample


def augment_on_device(task: SSLTask, images: Images, uniforms: torch.Tensor) -> list[torch.Tensor]:
    """``data.augment_on=device``: the views of a batch of images as read, augmented on the task's device with
    each sample's uniforms ``[N, views, 54]``, which the loader workers drew from (seed, epoch, index) as the
    per-image transform draws them: a sample's views do not depend on its batch, the number of processes or a
    resume (nothing to checkpoint), and match the workers pipeline's parameter for parameter."""
    views = task.device_augment.apply(images, uniforms)
    if task.channels_last:
        views = [v.contiguous(memory_format=torch.channels_last) for v in views]
    return views


def model_keywords(sample: dict[str, Any]) -> dict[str, Any]:
    """What the model takes besides the views, where the sample has it: ``masks`` (the mask stage's) and
    ``teacher_views`` (crops only a teacher sees: a Gram teacher's high-resolution crops, ``teacher_input``)."""
    keywords = {}
    if sample.get("masks") is not None:
        keywords["masks"] = sample["masks"]
    if sample.get("teacher_input") is not None:
        keywords["teacher_views"] = sample["teacher_input"]
    return keywords


def forward_and_loss(task: SSLTask, sample: dict[str, Any]) -> torch.Tensor:
    """Stage *forward and loss*, under the precision policy: the model's output (``on_forward`` fires), then
    the loss with the step context. Returns this rank's loss, attached to the graph; the logged terms of a
    loss that returns a dict go to ``task.last_batch.metrics``."""
    assert task.last_batch is not None, "read_sample starts the batch"
    timer = task.perf_stats.timer
    with precision(task):
        with timer("forward"):
            output = task.model(sample["input"], **model_keywords(sample))
        task.last_batch.model_output = output
        task.run_hooks(Event.ON_FORWARD)
        with timer("loss"):
            loss, terms = split_loss(task.loss(output, sample, task.context()))
    task.last_batch.loss = loss
    task.last_batch.metrics.update(terms)
    return loss


def reduce(task: SSLTask) -> torch.Tensor:
    """Stage *reduce*: the loss averaged over ranks (detached), added to the device-side meter and, in train
    phases, reported to the update guard; ``on_loss_and_meter`` fires. Returns the reduced loss."""
    lb = task.last_batch
    assert lb is not None and lb.loss is not None, "forward_and_loss computes the loss"
    with task.perf_stats.timer("loss_all_reduce"):
        reduced = all_reduce_mean(lb.loss.detach().float())
    lb.reduced_loss = reduced
    with task.perf_stats.timer("meters"):
        task.loss_sum += reduced
        task.loss_count += 1
    if task.train:
        task.guard.report_loss(task, reduced, lb.metrics, lb.sample)
    task.run_hooks(Event.ON_LOSS_AND_METER)
    return reduced


def backward(task: SSLTask) -> None:
    """Stage *backward* (train phases): gradients of ``loss / K`` (K micro-batches per update) added to those of
    the step's earlier micro-batches, through the GradScaler with float16."""
    lb = task.last_batch
    assert lb is not None and lb.loss is not None
    clock = task.clock
    with task.perf_stats.timer("backward"):
        if clock.micro_batch == 0:
            task.optimizer.zero_grad(set_to_none=True)
        scaled = lb.loss / clock.micro_batches if clock.micro_batches > 1 else lb.loss
        if task.scaler is not None:
            task.scaler.scale(scaled).backward()
        else:
            scaled.backward()


def forward_backward(task: SSLTask) -> None:
    """One micro-batch of the standard step: sample -> forward and loss -> reduce -> backward (train phases)."""
    sample = read_sample(task)
    forward_and_loss(task, sample)
    reduce(task)
    if task.train:
        backward(task)


def _sync_context(task: SSLTask, last_micro_batch: bool) -> contextlib.AbstractContextManager[None]:
    """DDP's ``no_sync`` (FSDP2's ``set_requires_gradient_sync(False)``) when its reduction must not run after this
    backward: under manual gradient reduction, and on every micro-batch but the last when accumulating."""
    if is_sharded(task.model):
        return gradient_sync(task.model, last_micro_batch)
    no_sync = getattr(task.model, "no_sync", None)
    if no_sync is not None and (task.manual_gradient_reduction or not last_micro_batch):
        return no_sync()
    return contextlib.nullcontext()


def run_micro_batches(task: SSLTask, body: Callable[[SSLTask], None] = forward_backward) -> None:
    """Run ``body`` once per micro-batch of this step (``optim.micro_batches`` in train phases, else once),
    each under the phase's grad mode and, but for the last, DDP's ``no_sync``; ``task.clock.micro_batch`` says
    which. An out-of-memory error is reported to the update guard (which halts, or lets :func:`update` drop the
    step on every rank); the step's remaining micro-batches are then read and dropped, so the data position stays
    what a resume computes. Train phases end with the manual gradient reduction (when configured) and
    ``on_backward``, unless the step ran out of memory."""
    clock = task.clock
    train = task.train
    if train:
        task.guard.begin_step(task)
    grad = torch.enable_grad if train else torch.no_grad
    out_of_memory = False
    for micro in range(clock.micro_batches):
        clock.micro_batch = micro
        try:
            with grad(), _sync_context(task, micro == clock.micro_batches - 1):
                body(task)
        except torch.OutOfMemoryError as exc:
            task.guard.report_oom(task, exc)
            out_of_memory = True
            for _ in range(micro + 1, clock.micro_batches):
                next(task.data_iterator)
            break
    clock.micro_batch = 0
    if not train:
        return
    if out_of_memory:  # free what the failed pass held before anything else allocates (and before agreeing)
        task.last_batch = LastBatch(sample={})
        task.optimizer.zero_grad(set_to_none=True)
        if task.device.type == "cuda":
            torch.cuda.empty_cache()
    if task.guard.out_of_memory(task):  # on every rank: any rank out of memory drops the step everywhere
        return
    if task.manual_gradient_reduction:
        with task.perf_stats.timer("gradient_all_reduce"):
            all_reduce_gradients(task.base_model.parameters(), task.bucket_cap_mb)
    task.run_hooks(Event.ON_BACKWARD)


def unscale_gradients(task: SSLTask) -> None:
    """Divide the gradients by the GradScaler's scale now (float16), so that a custom step can clip or inspect
    true gradients before :func:`update`; nothing to do without a scaler."""
    if task.scaler is None or task.last_batch is None:
        return
    if any(p.grad is not None for group in task.optimizer.param_groups for p in group["params"]):
        task.scaler.unscale_(task.optimizer)  # (a step that ran out of memory has no gradients to unscale)
        task.last_batch.unscaled = True


def clip_gradients(task: SSLTask) -> torch.Tensor:
    """Clip the gradients to ``task.clip_grad`` and log the norm they had (``grad_norm``, on the device).

    Runs in :func:`update` just before the optimizer step: after the step's last micro-batch (the accumulated
    gradients), after the gradient reduction and ``on_backward`` (a parameter whose gradient a hook dropped
    is left out), and after unscaling under float16 (:func:`unscale_gradients`). ``global`` mode scales
    every gradient by ``min(1, clip / total norm)`` (``torch.nn.utils.clip_grad_norm_``: fairseq, MAE,
    DINOv2); ``per_parameter`` scales each parameter's gradient by ``min(1, clip / (its norm + 1e-6))``
    (DINO's ``utils.clip_gradients``). The logged norm is the global one before clipping, either way. No
    host-device synchronisation. With several students (optimizer groups with an ``owner``) each student's
    gradients are clipped by their own norm (as separate optimizers would), each logged as ``grad_norm_<name>``."""
    unscale_gradients(task)
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
    if task.last_batch is not None:
        task.last_batch.metrics["grad_norm"] = total.detach()
        if len(norms) > 1:  # several students: each one's norm, each clipped alone
            task.last_batch.metrics.update({f"grad_norm_{owner.rsplit('.', 1)[-1]}": n.detach()
                                            for owner, n in norms.items()})
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


def update(task: SSLTask) -> None:
    """Stage *update* (train phases; nothing in eval phases): ask the update guard, then either drop the update
    or set the lr and weight decay at the clock (recorded for the log), step the optimizer (through
    the GradScaler), fire ``on_update``; the clock moves on either way."""
    if not task.train:
        return
    clock = task.clock
    reason = task.guard.decide(task)
    if reason is not None:
        if task.scaler is not None and task.last_batch is not None and task.last_batch.unscaled:
            task.scaler.update()  # close the scaler's step that unscale_ opened (it backs off on an inf)
        task.guard.drop(task, reason)  # raises once too many in a row were dropped
        clock.step += 1
        return
    task.guard.applied()
    if task.clip_grad > 0:
        clip_gradients(task)
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
