"""Optimizers (SGD, LARS, Adam, AdamW), parameter groups, and the schedules of per-update values for sslkit."""

from sslkit.optim.build import OPTIMIZER_NAMES, build_optimizer, set_lr, set_weight_decay
from sslkit.optim.lars import LARS
from sslkit.optim.param_groups import param_groups
from sslkit.optim.schedules import SCALING_RULES, SCHEDULE_NAMES, ClockSchedule, OnProgress, build_schedule, scaled_lr

__all__ = [
    "LARS",
    "OPTIMIZER_NAMES",
    "SCALING_RULES",
    "SCHEDULE_NAMES",
    "ClockSchedule",
    "OnProgress",
    "build_optimizer",
    "build_schedule",
    "param_groups",
    "scaled_lr",
    "set_lr",
    "set_weight_decay",
]
