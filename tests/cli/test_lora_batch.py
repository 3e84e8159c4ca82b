"""`jaxserve batch` with LoRA adapters: a line's "model" names an adapter (or the base model),
an unknown name is that line's error record while the others run, and the command takes
vLLM's LoRA flags. On the arithmetic fake runner (`support.lora_fakes`: each adapter shifts
the tokens by its own offset, so the oracle tells which adapter ran each line)."""

from __future__ import annotations

import argparse
import pathlib

import pytest
from support.engine_fixtures import tiny_tokenizer
from support.jsonl import read_jsonl, write_jsonl
from support.lora_fakes import lora_fake_engine, lora_oracle, write_peft_dir

from jaxserve.cli import flags
from jaxserve.cli.batch_io import LineError, parse_line
from jaxserve.cli.batch_job import BatchOptions, add_batch_arguments, run_batch
from jaxserve.lora_config import LoRAConfig

PROMPT = [11, 12, 13, 14]
TOKENS = 5


def test_lines_pick_their_adapter_and_unknown_ones_fail_alone(tmp_path: pathlib.Path) -> None:
    a = write_peft_dir(tmp_path / "a", 5, seed=1)
    b = write_peft_dir(tmp_path / "b", 9, seed=2)
    engine = lora_fake_engine((("a", str(a)), ("b", str(b))), max_loras=1)  # slot pressure
    lines = [{"id": 1, "prompt": PROMPT, "model": "a"},
             {"id": 2, "prompt": PROMPT},
             {"id": 3, "prompt": PROMPT, "model": "nope"},
             {"id": 4, "prompt": PROMPT, "model": "b"},
             {"id": 5, "prompt": PROMPT, "model": "base-name"},
             {"id": 6, "prompt": PROMPT, "model": "a"}]
    write_jsonl(tmp_path / "in.jsonl", [{**x, "max_tokens": TOKENS, "temperature": 0,
                                         "ignore_eos": True} for x in lines])
    summary = run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl",
                        BatchOptions(progress=False, model_names=("base-name",)))
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == [1, 2, 3, 4, 5, 6]
    assert (summary.ok, summary.errors) == (5, 1)
    offsets = {1: 5, 2: 0, 4: 9, 5: 0, 6: 5}
    for r in out:
        if r["id"] == 3:
            assert "model 'nope'" in r["error"] and "'a', 'b'" in r["error"], r
            continue
        assert r["text"] == tiny_tokenizer().decode(lora_oracle(PROMPT, TOKENS,
                                                                offsets[r["id"]])), r


def test_model_must_be_a_string() -> None:
    got = parse_line('{"id": 1, "prompt": "w3", "model": 5}', 1)
    assert isinstance(got, LineError) and "model=5 must be a string" in got.error
    assert parse_line('{"id": 1, "prompt": "w3", "model": "a"}', 1).model == "a"


def test_batch_takes_the_lora_flags(tmp_path: pathlib.Path) -> None:
    p = argparse.ArgumentParser()
    add_batch_arguments(p)
    args = p.parse_args(["in.jsonl", "out.jsonl", "--enable-lora", "--lora-modules",
                         f"a={tmp_path}", "--max-loras", "3", "--max-lora-rank", "32"])
    config = flags.engine_config_from_args(args)
    assert config.lora_config == LoRAConfig(max_loras=3, max_lora_rank=32,
                                            lora_modules=(("a", str(tmp_path)),))
    with pytest.raises(ValueError, match="max_loras.*enable_lora"):
        flags.engine_config_from_args(p.parse_args(["i", "o", "--max-loras", "2"]))
