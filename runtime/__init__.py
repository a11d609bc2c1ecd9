"""autopipe.runtime: model + Plan -> running pipeline (GPipe executor, one process)."""

from autopipe.runtime.batchnorm import DeferredBatchNorm
from autopipe.runtime.gpipe import GPipe
from autopipe.runtime.parallelize import build_pipeline
from autopipe.runtime.pipeline import Pipeline
from autopipe.runtime.recorder import TimelineRecorder

from autopipe.core.timeline import Timeline, load_chrome_trace, save_chrome_trace, to_chrome_trace

__all__ = [
    "DeferredBatchNorm",
    "GPipe",
    "Pipeline",
    "Timeline",
    "TimelineRecorder",
    "build_pipeline",
    "load_chrome_trace",
    "save_chrome_trace",
    "to_chrome_trace",
]
