"""Workers and the task API: `from worker import task`."""

from worker.context import TaskContext
from worker.pool import Worker
from worker.registry import Registry, task

__all__ = ["Registry", "TaskContext", "Worker", "task"]
