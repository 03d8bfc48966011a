"""Hooks: the base class and events, and the standard hooks (importing registers them)."""

from sslkit.hooks.base import Event, SSLHook
from sslkit.hooks.checkpoint import CheckpointHook
from sslkit.hooks.consistency import ConsistencyCheckHook
from sslkit.hooks.ema import MomentumTeacherHook
from sslkit.hooks.freeze import FreezeParametersHook
from sslkit.hooks.knn import KNNHook
from sslkit.hooks.logging import JsonlSink, LogHook
from sslkit.hooks.monitor import CollapseMonitorHook
from sslkit.hooks.online import OnlineMonitorHook
from sslkit.hooks.preemption import PreemptionHook
from sslkit.hooks.tensorboard import TensorboardSink

__all__ = [
    "CheckpointHook",
    "CollapseMonitorHook",
    "ConsistencyCheckHook",
    "Event",
    "FreezeParametersHook",
    "JsonlSink",
    "KNNHook",
    "LogHook",
    "MomentumTeacherHook",
    "OnlineMonitorHook",
    "PreemptionHook",
    "SSLHook",
    "TensorboardSink",
]
