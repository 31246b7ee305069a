"""`minserve bench prefix`'s workloads, runs and table, on a tiny model: the accounting is right.

Only counts are asserted (hit rates against the workloads' ideal); speed is the
benchmark program's business, not a test's.
"""

from __future__ import annotations

import pytest

from minserve import LLM
from minserve.bench.prefix import (
    MultiTurnWorkload,
    SharedPrefixWorkload,
    run_multi_turn,
    run_shared_prefix,
)
from minserve.cli import main

SHARED = SharedPrefixWorkload(
    num_prefixes=2, prefix_len=16, questions_per_prefix=3, question_len=4, output_len=2
)


@pytest.fixture(scope="module")
def make_engine(tiny_model):
    def make(**options):
        return LLM(tiny_model("llama"), block_size=4, num_blocks=128, **options).engine

    return make


def test_shared_prefix_workload_shuffles_p_prompts_times_q_questions():
    prompts = SHARED.prompts(vocab_size=1000)
    assert len(prompts) == 6 and all(len(p) == 20 for p in prompts)
    assert len({tuple(p[:16]) for p in prompts}) == 2
    assert SHARED.ideal_hit_rate == pytest.approx(2 * 2 * 16 / (6 * 20))


def test_the_cache_reaches_the_ideal_hit_rate_when_all_requests_arrive_at_once(make_engine):
    """Blocks are cached as they are scheduled, so even requests admitted in the same step
    as the first one of their prefix reuse it."""
    on = run_shared_prefix("on", make_engine, SHARED, enable_prefix_caching=True)
    off = run_shared_prefix("off", make_engine, SHARED)
    assert on.hit_rate == pytest.approx(SHARED.ideal_hit_rate) and off.hit_rate == 0.0
    assert on.prompt_tokens == off.prompt_tokens == 6 * 20
    assert on.output_tokens == off.output_tokens == 6 * 2


def test_multi_turn_reuses_earlier_turns_up_to_whole_blocks(make_engine):
    chat = MultiTurnWorkload(conversations=2, turns=3, user_len=5, output_len=3)
    run = run_multi_turn("on", make_engine, chat, enable_prefix_caching=True)
    # turn 2 sees 8 tokens of history (7 computed): 4 cached; turn 3 sees 16 (15): 12
    assert run.cached_tokens == 2 * (4 + 12)
    assert run.ideal_cached_tokens == 2 * (8 + 16)


def test_bench_prefix_prints_every_run_and_the_summary(tiny_model, capsys):
    argv = ["bench", "prefix", "--model", str(tiny_model("llama")), "--num-prefixes", "2",
            "--prefix-len", "16", "--questions", "2", "--question-len", "4", "--output-len", "2",
            "--conversations", "2", "--turns", "2", "--user-len", "4", "--answer-len", "2",
            "--block-size", "4", "--num-blocks", "128"]  # fmt: skip
    assert main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    names = [row.split(" | ")[0][2:] for row in rows]
    assert names[:8] == ["run", "shared, cache off", "shared, cache on", "chat, cache off",
                         "chat, cache on", "shared, small pool, fcfs", "shared, small pool, lpm",
                         "shared, small pool, fcfs, host tier"]  # fmt: skip
    assert "measure" in names and "hit rate / ideal (shared prefix)" in names
