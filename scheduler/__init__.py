"""The async scheduler: admission, the engine thread, request streams."""

from scheduler.config import SchedulerConfig
from scheduler.loading import ModelInfo
from scheduler.scheduler import Scheduler, SchedulerState
from scheduler.stream import RequestStream, TokenEvent

__all__ = [
    "ModelInfo",
    "RequestStream",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerState",
    "TokenEvent",
]
