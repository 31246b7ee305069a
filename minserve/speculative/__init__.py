"""Speculative decoding: cheap proposers guess the next tokens, one target forward checks them.

See docs/speculative.md. `LLM(speculative_config={"method": "ngram" | "draft_model" |
"early_exit", "num_speculative_tokens": k, ...})` turns it on; `SpeculativeDecoder` is the
engine's hook.
"""

from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.decoder import SpeculativeDecoder

__all__ = ["SpeculativeConfig", "SpeculativeDecoder"]
