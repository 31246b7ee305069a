"""The `minserve` command line prints what the offline API generates."""

from __future__ import annotations

import argparse

import pytest

from minserve import LLM, SamplingParams
from minserve.cli import main
from minserve.server.cli import _engine_options, add_serve_parser


def test_generate_prints_prompt_and_greedy_completion(tiny_model, capsys) -> None:
    path = tiny_model("llama")
    assert main(["generate", "Hello there", "--model", str(path), "--max-tokens", "6"]) == 0
    expected = LLM(path).generate("Hello there", SamplingParams(temperature=0, max_tokens=6))
    assert capsys.readouterr().out == "Hello there" + expected[0].outputs[0].text + "\n"


def test_generate_chat_applies_the_template(tiny_model, capsys) -> None:
    path = tiny_model("llama")
    assert main(["generate", "Hi", "--chat", "--model", str(path), "--max-tokens", "5"]) == 0
    messages = [{"role": "user", "content": "Hi"}]
    expected = LLM(path).chat(messages, SamplingParams(temperature=0, max_tokens=5))
    assert capsys.readouterr().out == expected[0].outputs[0].text + "\n"


def test_generate_reports_invalid_values_without_a_traceback(tiny_model, capsys) -> None:
    assert main(["generate", "Hi", "--model", str(tiny_model("llama")), "--top-p", "0"]) == 2
    assert capsys.readouterr().err == "minserve: error: top_p must be in (0, 1], got 0.0\n"


def test_generate_reports_a_missing_model_path(tmp_path, capsys) -> None:
    assert main(["generate", "Hi", "--model", str(tmp_path / "none.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_serve_takes_the_kv_cache_dtype_as_an_engine_option() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert _engine_options(parser.parse_args(["serve"]))["kv_cache_dtype"] == "auto"
    args = parser.parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert _engine_options(args)["kv_cache_dtype"] == "int8"
    with pytest.raises(SystemExit):  # argparse lists the choices
        parser.parse_args(["serve", "--kv-cache-dtype", "int4"])
