"""Structured output: a JSON schema, regex, choice or grammar the generated text must follow.

`SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))` asks for it (vLLM's
names); docs/engine.md ("Structured output") tells the whole path:

    grammar_spec.py  the request as one grammar text (choice -> EBNF, canonical JSON)
    compiler.py      the text -> xgrammar's compiled grammar over the model's vocabulary,
                     once per text (LRU cache), bounded in time
    grammar_ends.py  whether a compiled grammar can end: one that cannot is refused
    matcher.py       one sample's state in its grammar: a bitmask of allowed tokens, advanced
                     by each token the sample keeps (owned by the `Sample`)

The sampler (`minserve/model/sampler.py`, `apply_token_bitmasks`) sets the logits of the
tokens a row's grammar forbids to -inf before anything else looks at them, on every
sampling path. The modules are imported on first use: xgrammar loads only in engines that
get a structured request.
"""
