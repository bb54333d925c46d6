"""The serving scheduler: pure decisions (``core``, ``cost``, ``prefix``) and the control-process
service that carries them out (``service``)."""
from residency.control.scheduler.config import SchedulerConfig
from residency.control.scheduler.core import Admit, PendingRequest, Refuse, Scheduler, Wait
from residency.control.scheduler.cost import CostModel, PrefixDecision

__all__ = ["SchedulerConfig", "Admit", "PendingRequest", "Refuse", "Scheduler", "Wait", "CostModel", "PrefixDecision"]
