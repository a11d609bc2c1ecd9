"""autopipe.runtime: model + Plan -> running pipeline (GPipe executor, one process)."""

from autopipe.runtime.batchnorm import DeferredBatchNorm
from autopipe.runtime.gpipe import GPipe
from autopipe.runtime.timeline import TaskRecord, Timeline, save_chrome_trace, to_chrome_trace

__all__ = [
    "DeferredBatchNorm",
    "GPipe",
    "TaskRecord",
    "Timeline",
    "save_chrome_trace",
    "to_chrome_trace",
]
