"""Known failure modes of SSL training, recognised in the logged metrics: warnings that name the cause and the fix.

The log hook hands every record it writes (values already on the host: no extra sync) to :class:`StabilityWatch`,
which checks them against the failure modes users meet with the distillation methods (docs/methods.md,
"Stability"; the sources are cited there):

* ``koleo_duplicates``: KoLeo's nearest-neighbour distance near 0 (DINOv2's ``koleo_min_distance``): two images
  of a batch have the same embedding, and ``-log(distance)`` grows without bound. Duplicate images in the data;
* ``loss_at_log_k``: the DINO / iBOT / DINOv2 CLS loss stays at ``ln K`` (``K`` prototypes): student and teacher are
  both uniform, nothing is learned;
* ``hot_teacher``: the teacher's entropy stays near ``ln K``: centring wins over sharpening, the collapse a too-hot
  teacher causes (DINO, section 5.3);
* ``one_hot_teacher``: the teacher's entropy near 0: sharpening wins, every image on one prototype;
* ``collapsed_embeddings``: the collapse monitor's ``embedding_std_ratio`` near 0, for any method;
* ``fp16_low_temperature`` (at the start, and in the update guard's message for a non-finite loss): float16
  autocast with temperatures below 0.1, where logits / temperature pass float16's largest value.

Each is logged once per run (as a warning and as a ``warning`` record in metrics.jsonl). The checks on the teacher
wait until the teacher temperature's warm-up and the first ``settle`` of the run are over: a DINO teacher starts
near uniform.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from sslkit.optim.schedules import TeacherTemperature

__all__ = ["StabilityWatch", "diagnose", "fp16_temperature_warning", "prototypes", "temperatures"]

logger = logging.getLogger("sslkit")

#: KoLeo distances below this (L2-normalised vectors: distances in [0, 2]) mean duplicates.
KOLEO_DUPLICATE = 1e-3
#: Teacher entropy above this fraction of ln K: uniform; below ``ONE_HOT`` of it: one prototype.
UNIFORM, ONE_HOT = 0.97, 0.05
#: ``embedding_std_ratio`` (about 1 when healthy) below this: collapsed.
COLLAPSED = 0.05
#: float16's largest finite value.
FP16_MAX = 65504.0


def prototypes(loss: Any) -> int | None:
    """``K``, the number of prototypes of a DINO-family loss (its ``out_dim``), or None for other losses."""
    k = getattr(loss, "out_dim", None)
    return k if isinstance(k, int) and k > 1 else None


def temperatures(loss: Any) -> dict[str, float]:
    """The temperatures a loss divides its logits by (``loss.<name>``), for the messages and the float16 check."""
    found = {}
    # (in the order the messages name them when two are equal)
    for name in ("student_temp", "teacher_patch_temp", "teacher_temp", "temperature"):
        value = getattr(loss, name, None)
        if isinstance(value, TeacherTemperature):  # its final and warm-up values
            found[name], found[f"warmup_{name}"] = value.final, value.warmup
        elif isinstance(value, float):
            found[name] = value
    return {name: value for name, value in found.items() if value > 0}


def fp16_temperature_warning(loss: Any, amp_dtype: torch.dtype | None) -> str | None:
    """The warning for float16 autocast with temperatures below 0.1 (None otherwise)."""
    temps = temperatures(loss)
    if amp_dtype != torch.float16 or not temps or min(temps.values()) >= 0.1:
        return None
    name, low = min(temps.items(), key=lambda kv: kv[1])
    return (f"amp.dtype=float16 with loss.{name}={low:g}: a logit above {FP16_MAX * low:.0f} divided by it passes "
            f"float16's largest value ({FP16_MAX:.0f}) and becomes inf, then the loss NaN (DINO's and iBOT's "
            f"reference code hit this with --use_fp16). sslkit's losses divide and exponentiate in float32, but the "
            f"heads' logits are float16 under this autocast. Use amp.dtype=bfloat16 (same range as float32), or "
            f"keep the head's last layer normalised (model.head.norm_last_layer=true).")


def diagnose(record: dict[str, Any], k: int | None, where: float, settled: bool) -> dict[str, str]:
    """The failure modes ``record`` (one logged record) shows: ``{key: message}``. ``k``: the prototypes of a
    DINO-family loss (None for other losses); ``where``: progress in [0, 1); ``settled``: past the warm-ups."""
    found: dict[str, str] = {}
    koleo = record.get("koleo_min_distance")
    if isinstance(koleo, float) and koleo < KOLEO_DUPLICATE:
        found["koleo_duplicates"] = (
            f"KoLeo: two images of a batch have nearly the same embedding (nearest-neighbour distance {koleo:.2g}), "
            f"so KoLeo's -log(distance) is huge (it is infinite at 0; koleo_loss={record.get('koleo_loss', 0):.3g}). "
            "The usual cause is duplicate images in the data (DINOv2 deduplicates its LVD-142M for this), else a "
            "collapsing backbone. Deduplicate the dataset, or lower loss.koleo_weight (0 turns KoLeo off).")
    std = record.get("embedding_std_ratio")
    entropy = record.get("teacher_entropy")
    if k is not None and settled and isinstance(entropy, float):
        ln_k = math.log(k)
        temp = record.get("teacher_temp")
        temp_text = f"loss.teacher_temp (now {temp:.3g})" if isinstance(temp, float) else "loss.teacher_temp"
        cls_loss = record.get("cls_loss", record.get("loss"))
        if isinstance(cls_loss, float) and abs(cls_loss - ln_k) < 0.02 * ln_k:
            found["loss_at_log_k"] = (
                f"the CLS loss is stuck at ln K = ln {k} = {ln_k:.3f} ({cls_loss:.3f}): student and teacher are both "
                f"uniform over the {k} prototypes and nothing is learned. Lower {temp_text} (DINO: 0.04 to 0.07), "
                "lower optim.lr or lengthen optim.warmup_epochs, keep model.head.norm_last_layer=true, and freeze the "
                "last layer for the first epoch (dino_freeze_last_layer).")
        if entropy >= UNIFORM * ln_k:
            spread = f"; embedding_std_ratio {std:.3f}" if isinstance(std, float) else ""
            found["hot_teacher"] = (
                f"the teacher is near uniform (entropy {entropy:.3f} of ln K = {ln_k:.3f}{spread}): centring wins over "
                f"sharpening, the collapse of a too-hot teacher. Lower {temp_text} or loss.warmup_teacher_temp (DINO "
                "trains with 0.04 to 0.07 and fails above 0.07 without warm-up), or use fewer prototypes "
                "(model.head.out_dim and loss.out_dim).")
        elif entropy <= ONE_HOT * ln_k:
            found["one_hot_teacher"] = (
                f"the teacher puts almost all its mass on one prototype (entropy {entropy:.3f} of ln K = {ln_k:.3f}): "
                f"sharpening wins over centring. Raise {temp_text}, or lower loss.center_momentum so that the centre "
                "follows the teacher faster.")
    if isinstance(std, float) and std < COLLAPSED and where > 0.05:
        found["collapsed_embeddings"] = (
            f"the embeddings have collapsed (embedding_std_ratio {std:.3g}, about 1 when spread): every image maps "
            "to nearly the same point. Lower optim.lr, check the method's collapse guard (BYOL/SimSiam's predictor, "
            "a teacher's momentum, VICReg's variance weight), or raise data.batch_size for contrastive methods.")
    return found


class StabilityWatch:
    """Checks each logged record (:func:`diagnose`) and warns once per failure mode per run."""

    def __init__(self, settle: float = 0.1) -> None:
        self.settle = float(settle)
        self.warned: set[str] = set()

    def start(self, task: Any) -> list[str]:
        """Warnings due before the first step (float16 with low temperatures); logged, and returned."""
        message = fp16_temperature_warning(task.loss, task.amp_dtype)
        if message is None or "fp16_low_temperature" in self.warned:
            return []
        self.warned.add("fp16_low_temperature")
        logger.warning("stability: %s", message)
        return [message]

    def check(self, task: Any, record: dict[str, Any]) -> list[dict[str, Any]]:
        """Warn about the failure modes ``record`` shows that were not warned about yet; return their records
        (``{"step", "epoch", "phase": "warning", "warning", "message"}``) for the metric sinks."""
        loss = task.loss
        clock = task.clock
        schedule = getattr(loss, "teacher_temp", None)
        warmup = schedule.warmup_steps if isinstance(schedule, TeacherTemperature) else 0
        settled = clock.where >= self.settle and clock.step >= warmup
        out = []
        for key, message in diagnose(record, prototypes(loss), clock.where, settled).items():
            if key in self.warned:
                continue
            self.warned.add(key)
            logger.warning("stability (step %d): %s", task.clock.step, message)
            out.append({"step": task.clock.step, "epoch": task.clock.epoch, "phase": "warning", "warning": key,
                        "message": message})
        return out
