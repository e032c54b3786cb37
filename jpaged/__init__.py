"""jpaged: PagedAttention LLM inference in JAX and Pallas."""
from jpaged.engine import LLMEngine
from jpaged.llm import LLM
from jpaged.outputs import BeamSearchOutput, CompletionOutput, RequestMetrics, RequestOutput
from jpaged.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "BeamSearchOutput", "RequestMetrics"]
__version__ = "0.1.0"
