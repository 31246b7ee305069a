"""The OpenAI-compatible server: FastAPI routes over an engine loop in a background thread.

protocol.py      request bodies (strict pydantic models)
async_engine.py  the engine thread; per-request asyncio queues
serving.py       completions and chat handlers, streaming and not
streaming.py     engine deltas -> numbered stream pieces; usage counts
responses.py     OpenAI response shapes, usage, logprobs
errors.py        OpenAI error bodies, body-size cap, API key
metrics.py       Prometheus metrics
app.py           the routes; build_server(engine, config)
background.py    uvicorn in a thread (notebooks, tests, benchmarks)
cli.py           `minserve serve`
"""
