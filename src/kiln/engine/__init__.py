"""The paged-KV inference engine: LLM (offline), LLMEngine (step-level, for the server)."""

from kiln.engine.config import EngineConfig
from kiln.engine.llm import LLM
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.outputs import EngineStats, RequestOutput
from kiln.engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "EngineStats",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
