"""minserve: an educational LLM-serving engine you can read, run on a laptop, and trust.

The offline API mirrors vLLM's:

    from minserve import LLM, SamplingParams
    llm = LLM()  # the bundled SmolLM2-135M-Instruct
    out = llm.generate("The capital of France is", SamplingParams(temperature=0))
    print(out[0].outputs[0].text)
"""

# OpenMP's threads sleep rather than spin between parallel regions (a busy core elsewhere
# would stall every region); libgomp reads that as torch loads it, so this comes first.
from minserve import openmp_env  # noqa: F401, I001

# On a machine without CUDA, Triton kernels run in its interpreter; Triton reads that choice
# (TRITON_INTERPRET=1) as it is imported, so the package makes it before anything else.
from minserve.attention import triton_env  # noqa: F401
from minserve.engine_args import EngineArgs
from minserve.engine_builder import build_engine
from minserve.errors import ModelLoadError, PromptTooLongError
from minserve.llm import LLM
from minserve.plugins import CoursePlugins
from minserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "CoursePlugins",
    "EngineArgs",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "build_engine",
]
__version__ = "0.1.0"
