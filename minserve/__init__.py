"""minserve: an educational LLM-serving engine you can read, run on a laptop, and trust.

The offline API mirrors vLLM's:

    from minserve import LLM, SamplingParams
    llm = LLM()  # the bundled SmolLM2-135M-Instruct
    out = llm.generate("The capital of France is", SamplingParams(temperature=0))
    print(out[0].outputs[0].text)
"""

from minserve.errors import ModelLoadError, PromptTooLongError
from minserve.llm import LLM
from minserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minserve.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
