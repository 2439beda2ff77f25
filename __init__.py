"""pagedserve: distributed, tensor-parallel LLM serving with a paged KV cache."""
from pagedserve.config import EngineArgs
from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "BeamSearchParams", "RequestOutput",
           "CompletionOutput", "Logprob", "BeamSearchOutput", "BeamSearchSequence"]
__version__ = "0.1.0"
