"""kvscope: an LLM inference server and library whose requests cancel in milliseconds
and free their KV cache at once, leaving every other request untouched."""

from kvscope.actors.engine import Engine
from kvscope.actors.handles import Job, MergedStream, Request, merge_streams
from kvscope.actors.messages import CancelReport, Completion, Delta, RequestInfo
from kvscope.beam_search import BeamSearchParams
from kvscope.config import EngineConfig
from kvscope.errors import (
    EngineClosed,
    EngineOverloaded,
    InvalidRequest,
    KvscopeError,
    RequestConflict,
    UnknownRequest,
)
from kvscope.kernels.logprobs import TokenLogprobs
from kvscope.models.tokenizer import Tokenizer
from kvscope.params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "BeamSearchParams",
    "CancelReport",
    "Completion",
    "Delta",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineOverloaded",
    "InvalidRequest",
    "Job",
    "KvscopeError",
    "MergedStream",
    "Request",
    "RequestConflict",
    "RequestInfo",
    "SamplingParams",
    "TokenLogprobs",
    "Tokenizer",
    "UnknownRequest",
    "merge_streams",
]
