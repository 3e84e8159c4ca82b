"""LoRAConfig and its option forms: vLLM's names, each bad value refused naming the option."""

from __future__ import annotations

import argparse

import pytest

from jaxserve.cli.flags import add_engine_flags, engine_config_from_args
from jaxserve.lora_config import LoRAConfig, parse_lora_modules


def test_options_off_on_and_defaults() -> None:
    assert LoRAConfig.from_options({}) is None
    cfg = LoRAConfig.from_options({"enable_lora": True})
    assert cfg == LoRAConfig() and cfg.num_slots == 2 and cfg.num_cpu_loras == 1
    cfg = LoRAConfig.from_options({"enable_lora": True, "max_loras": 4, "max_lora_rank": 64,
                                   "max_cpu_loras": 6, "lora_dtype": "bfloat16",
                                   "lora_modules": ["a=/p/a", '{"name": "b", "path": "/p/b"}']})
    assert (cfg.max_loras, cfg.max_lora_rank, cfg.num_cpu_loras, cfg.lora_dtype) == \
        (4, 64, 6, "bfloat16")
    assert cfg.lora_modules == (("a", "/p/a"), ("b", "/p/b"))


@pytest.mark.parametrize("options,match", [
    ({"max_loras": 2}, "max_loras is a LoRA option: it needs enable_lora"),
    ({"lora_modules": ["a=/x"]}, "lora_modules is a LoRA option"),
    ({"enable_lora": "yes"}, "enable_lora="),
    ({"enable_lora": True, "max_loras": 0}, "max_loras=0"),
    ({"enable_lora": True, "max_lora_rank": 513}, r"max_lora_rank=513 .*\[1, 512\]"),
    ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras=2 must be >="),
    ({"enable_lora": True, "lora_dtype": "int8"}, "lora_dtype='int8'"),
    ({"enable_lora": True, "lora_modules": ["a"]}, "NAME=PATH"),
    ({"enable_lora": True, "lora_modules": ["a=/x", "a=/y"]}, r"\['a'\] appear more than once"),
    ({"enable_lora": True, "lora_modules": ["bad name=/x"]}, "without spaces"),
    ({"enable_lora": True, "lora_modules": ['{"name": "a", "path": "/x", "base_model_name":'
                                            ' "m"}']}, "base_model_name"),
])
def test_bad_options_are_named(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LoRAConfig.from_options(options)


def test_module_forms() -> None:
    assert parse_lora_modules({"a": "/x"}) == (("a", "/x"),)
    assert parse_lora_modules("a=/x") == (("a", "/x"),)
    assert parse_lora_modules([("a", "/x")]) == (("a", "/x"),)
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_lora_modules(['{"name": '])


def test_cli_flags_build_the_section() -> None:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    cfg = engine_config_from_args(p.parse_args([
        "--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2",
        "--max-lora-rank", "8", "--max-cpu-loras", "3", "--lora-dtype", "bfloat16"]))
    assert cfg.lora_config == LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=3,
                                         lora_modules=(("a", "/x"), ("b", "/y")),
                                         lora_dtype="bfloat16")
    assert engine_config_from_args(p.parse_args([])).lora_config is None
    with pytest.raises(ValueError, match="needs enable_lora"):
        engine_config_from_args(p.parse_args(["--max-lora-rank", "8"]))
