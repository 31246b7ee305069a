"""One way to build an engine: `EngineArgs` (vLLM's names), `CoursePlugins` beside them,
`build_engine` for every caller; `LLM` keeps vLLM's short signature."""

from __future__ import annotations

import inspect

import pytest
from test_engine import random_workload, token_ids

import minserve
from minserve import LLM, CoursePlugins, EngineArgs, build_engine
from minserve.engine import LLMEngine
from minserve.engine_args import option_names
from minserve.plugins import plugin_names


def test_llm_takes_at_most_twenty_parameters_and_every_engine_option_by_name() -> None:
    params = [p for p in inspect.signature(LLM.__init__).parameters if p != "self"]
    assert len(params) <= 20, params
    named = {p for p in params if p not in ("plugins", "engine_options")}
    assert named <= set(option_names())  # each is an EngineArgs field, same spelling
    assert not set(plugin_names()) & set(params)  # the course's plug-ins: one argument


def test_an_unknown_option_is_refused_with_the_options_and_a_plugin_is_pointed_to_plugins() -> None:
    with pytest.raises(TypeError, match="unknown engine option.*max_num_seqs"):
        EngineArgs.from_options(max_num_seq=4)
    with pytest.raises(TypeError, match=r"plugins=CoursePlugins\(scheduler_cls=...\)"):
        LLM(scheduler_cls=object)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(engine="contiguous"), "unknown engine 'contiguous'"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be at least 1"),
        (dict(engine="reference", kv_cache_dtype="int8"), "stores the paged engine's KV pool"),
        (dict(tensor_parallel_size=2, quantization="gguf"), "quantization runs in one process"),
        (
            dict(engine="reference", speculative_config={"method": "ngram"}),
            "speculative_config needs engine='paged'",
        ),
        (dict(num_blocks=4, kv_cache_memory_bytes=1 << 20), "not both"),
        (dict(max_num_seqs=0), "max_num_seqs must be at least 1"),
        (
            dict(speculative_config={"method": "medusa", "num_speculative_tokens": 2}),
            "unknown speculative method",
        ),
    ],
)
def test_engine_args_refuse_what_cannot_run_before_anything_loads(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**options)


@pytest.mark.parametrize(
    ("options", "plugins", "message"),
    [
        (dict(), dict(tensor_parallel_layers="x"), "tensor_parallel_layers applies with"),
        (dict(), dict(prefix_cache_cls=dict), "prefix_cache_cls is used only with"),
        (dict(), dict(swap_space_cls=dict), "swap_space_cls is used only with swap_space"),
        (dict(engine="reference"), dict(scheduler_cls=dict), "scheduler_cls plugs into the paged"),
        (dict(tensor_parallel_size=2), dict(model_ops=object()), "model_ops runs in one process"),
        (dict(tensor_parallel_size=2), dict(kv_pool_cls=dict), "kv_pool_cls runs in one process"),
        (dict(engine="reference"), dict(kv_pool_cls=dict), "kv_pool_cls plugs into the paged"),
        (dict(), dict(step_cost_model_cls=dict), "step_cost_model_cls is fitted by the step-time"),
    ],
)
def test_plugins_are_checked_once_against_the_options(options, plugins, message) -> None:
    with pytest.raises(ValueError, match=message):
        CoursePlugins(**plugins).check(EngineArgs(**options))


def test_a_stop_matcher_without_feed_and_flush_is_refused_as_the_plugins_are_made() -> None:
    with pytest.raises(TypeError, match="feed and flush"):
        CoursePlugins(stop_matcher_cls=dict)


def test_build_engine_gives_the_llms_tokens_and_the_reference_engines(tiny_model) -> None:
    """The engine built alone, the LLM's and the contiguous oracle agree token for token."""
    prompts, params = random_workload(8, seed=11)
    options = dict(block_size=4, num_blocks=64, max_num_batched_tokens=32)
    llm = LLM(tiny_model("llama"), **options)
    assert isinstance(llm.engine, LLMEngine)
    expected = token_ids(llm.generate(prompts, params, use_tqdm=False))
    oracle = LLM(llm.loaded, engine="reference")
    assert token_ids(oracle.generate(prompts, params, use_tqdm=False)) == expected
    engine = build_engine(EngineArgs(model=llm.loaded, **options))
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), None, prompt, sp)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            got.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert engine.max_model_len == llm.max_model_len
    assert engine.vocab_size == llm.vocab_size
    assert engine.get_tokenizer() is llm.get_tokenizer()
    assert engine.execution == llm.get_execution_config()
    engine.shutdown()  # one process: nothing beside it to stop


def test_a_students_ops_show_in_the_execution_config_of_both_engines(tiny_model) -> None:
    from minserve.model.ops import MODEL_OPS

    base = LLM(tiny_model("llama"), num_blocks=32)
    for engine in ("paged", "reference"):
        llm = LLM(base.loaded, num_blocks=32, engine=engine,
                  plugins=CoursePlugins(model_ops=MODEL_OPS))  # fmt: skip
        assert llm.get_execution_config().ops == "yours"
    assert LLM(base.loaded, num_blocks=32).get_execution_config().ops != "yours"


def test_the_package_names_the_one_way_to_build() -> None:
    assert {"EngineArgs", "CoursePlugins", "build_engine"} <= set(minserve.__all__)
