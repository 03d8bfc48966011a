"""The hook that reports a high-resolution phase: the clock's stage, the crop sizes each update trained on."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sslkit.data.resolution import HighResPhase
from sslkit.hooks.base import SSLHook

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["HighResolutionHook"]

logger = logging.getLogger("sslkit")


class HighResolutionHook(SSLHook):
    """The run's :class:`~sslkit.data.resolution.HighResPhase` as the clock and the logs see it: ``clock.stage``
    is ``"base"`` or ``"high_res"`` (a checkpoint's ``position.stage``), the switch is logged once, and each
    logged record holds ``crop_size`` and, with teacher crops, ``teacher_crop_size``: the sizes the step was fed
    (read from the batch's shapes, no device sync). The crops themselves come from the data pipeline, whose sampler
    names each sample's update (:meth:`~sslkit.data.sampler.StatefulDistributedSampler.updates_from`)."""

    name = "high_res"

    def __init__(self, phase: HighResPhase) -> None:
        self.phase = phase

    def on_start(self, task: SSLTask) -> None:
        """Set the clock's stage for the update the run starts at, and say what is coming."""
        task.clock.stage = self.phase.stage(task.clock.step)
        logger.info("high-resolution phase from update %d (now %s, update %d): global crops %s, local %s, teacher %s, "
                    "drawn per update with ratios %s", self.phase.start_step, task.clock.stage, task.clock.step,
                    list(self.phase.global_sizes), list(self.phase.local_sizes), list(self.phase.teacher_sizes),
                    list(self.phase.ratios))

    def on_forward(self, task: SSLTask) -> None:
        """The stage of this update, and the crop sizes its batch has."""
        if not task.train or task.last_batch is None:
            return
        clock = task.clock
        clock.stage = self.phase.stage(clock.step)
        if clock.step == self.phase.start_step and clock.micro_batch == 0:
            logger.info("high-resolution phase: update %d trains on the phase's crops", clock.step)
        sample = task.last_batch.sample
        task.scheduled["crop_size"] = float(sample["input"][0].shape[-1])
        if sample.get("teacher_input"):
            task.scheduled["teacher_crop_size"] = float(sample["teacher_input"][0].shape[-1])
