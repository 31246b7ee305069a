"""`build_engine`: the one way to build a paged engine from its options and plug-ins.

    args = EngineArgs(model=None, max_num_seqs=64)      # vLLM's names
    engine = build_engine(args)                          # load, place, build
    engine.add_request(...); engine.step(); engine.shutdown()

`LLM(...)`, `minserve serve`, the tensor-parallel driver's rank 0 and each prefill/decode
instance build their engines through it: the model is loaded on its platform (or, with
tensor_parallel_size > 1, each rank loads its shard), the plug-ins set the model's ops,
and `LLMEngine` builds the pool, the worker, the KV cache manager and the scheduler.
"""

from __future__ import annotations

import logging

from minserve.distributed.launcher import start_tensor_parallel
from minserve.engine import LLMEngine
from minserve.engine_args import EngineArgs
from minserve.loader import LoadedModel, load_model
from minserve.plugins import NO_PLUGINS, CoursePlugins

logger = logging.getLogger(__name__)


def build_engine(args: EngineArgs, plugins: CoursePlugins = NO_PLUGINS) -> LLMEngine:
    """A paged engine for `args`, with `plugins` in place of minserve's parts; call its
    `shutdown()` when done (it stops a tensor-parallel group's other ranks). How it runs
    here (device, dtype, ops, attention) is logged once at info level."""
    engine = _build(args, plugins)
    logger.info(engine.execution.summary())
    return engine


def _build(args: EngineArgs, plugins: CoursePlugins) -> LLMEngine:
    if args.engine != "paged":
        raise ValueError(f"build_engine builds the paged engine; got engine={args.engine!r}")
    plugins.check(args)
    if args.tensor_parallel_size == 1:
        loaded = load(args)
        plugins.install(loaded)
        return LLMEngine(loaded, args, plugins)
    driver = start_tensor_parallel(args, plugins.tensor_parallel_layers)
    try:
        plugins.install(driver.loaded)
        peers = driver.peers(args.cache)
        return LLMEngine(driver.loaded, args, plugins, peers, tensor_parallel=driver)
    except BaseException:
        driver.shutdown()
        raise


def load(args: EngineArgs) -> LoadedModel:
    """Load args.model on this machine's platform, or reuse it when it is loaded already
    (several engines, one set of weights)."""
    model = args.model
    if not isinstance(model, LoadedModel):
        return load_model(
            model, dtype=args.dtype, device=args.device, quantization=args.quantization
        )
    if args.dtype != "auto" or args.device != "auto" or args.quantization is not None:
        param = next(model.model.parameters())
        raise ValueError(
            "dtype, device and quantization apply when loading, and this model is loaded "
            f"already ({param.dtype} on {param.device}); leave them as 'auto' and None"
        )
    model.platform.plan_new_layers(model.model)  # layers quantized in place since the load
    return model
