"""The engine: ``Engine`` (one step = execute + pure commit), ``EngineLoop`` (the one loop that owns the state,
admits, aborts and steps) and the output processor (routes tokens to each request's tracker). Imports no torch.
"""

from fnvllm.engine.core import Engine, EngineOutput
from fnvllm.engine.loop import EngineLoop, EngineStats
from fnvllm.engine.output import OutputProcessor, RequestTracker
from fnvllm.engine.results import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta, group_outputs

__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineLoop",
    "EngineOutput",
    "EngineStats",
    "OutputProcessor",
    "RequestMetrics",
    "RequestOutput",
    "RequestTracker",
    "StreamDelta",
    "group_outputs",
]
