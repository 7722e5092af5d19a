"""stoker.observe: metric sinks and progress display (timing, doctor and report to come)."""

from stoker.observe.progress import Progress, build_progress
from stoker.observe.sinks import (
    JsonlSink,
    MetricSink,
    MultiSink,
    NullSink,
    TensorBoardSink,
    build_sinks,
)

__all__ = [
    "JsonlSink",
    "MetricSink",
    "MultiSink",
    "NullSink",
    "Progress",
    "TensorBoardSink",
    "build_progress",
    "build_sinks",
]
