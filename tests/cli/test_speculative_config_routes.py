"""`--speculative-config` / `LLM(speculative_config=...)`: every route a user has to the
engine's speculative decoding settings yields the same `EngineConfig.speculative_config`
(the oracle: `SpeculativeConfig.from_dict` of the same keys), and a bad value is one clean
error naming the flag (or argument) and the key. No engine is built."""

from __future__ import annotations

import json

import pytest

from jaxserve import llm as llm_module
from jaxserve.cli import batch_job, flags
from jaxserve.cli.main import build_parser, main
from jaxserve.config import EngineConfig, SpeculativeConfig

KEYS = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4, "disable_by_batch_size": 16}
EXPECTED = SpeculativeConfig.from_dict(KEYS)
# Every subcommand that builds an engine, with the arguments it needs besides the flag.
COMMANDS = {"generate": ["generate", "hi"], "serve": ["serve"], "batch": ["batch", "a", "b"],
            "bench": ["bench"], "tune": ["tune", "--ttft-p99", "1", "--itl-p99", "1"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_engine_command_takes_the_flag(command: str) -> None:
    args = build_parser().parse_args(COMMANDS[command]
                                     + ["--speculative-config", json.dumps(KEYS)])
    fixed = {"seed": args.seed} if command == "generate" else {}
    cfg = flags.engine_config_from_args(args, **fixed)
    assert cfg.speculative_config == EXPECTED
    assert cfg.speculative_config.prompt_lookup_max == 4
    # Not given: speculation stays off.
    args = build_parser().parse_args(COMMANDS[command])
    assert flags.engine_config_from_args(args, **fixed).speculative_config is None


def test_standalone_batch_parser_takes_the_flag() -> None:
    import argparse

    p = argparse.ArgumentParser()
    batch_job.add_batch_arguments(p)
    args = p.parse_args(["a", "b", "--speculative-config", json.dumps(KEYS)])
    assert flags.engine_config_from_args(args).speculative_config == EXPECTED


@pytest.mark.parametrize("text, words", [
    ('{"method": "ngram", "num_speculative_tokens": 3, "typo_key": 1}', ["'typo_key'"]),
    ('{"method": "medusa", "num_speculative_tokens": 3}', ["method='medusa'"]),
    ('{"method": "ngram", "num_speculative_tokens": 0}', ["num_speculative_tokens=0"]),
    ('{"method": "ngram"', ["not valid JSON"]),
    ('[1, 2]', ["object of keys"]),
])
def test_bad_flag_value_is_a_clean_cli_error(text: str, words: list[str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--speculative-config", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --speculative-config:" in err and "Traceback" not in err
    for w in words:
        assert w in err


def test_draft_tp_mismatch_is_refused_before_any_model_loads(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Checked by EngineConfig against --tensor-parallel-size: main's one-line error, exit 2.
    spec = {"method": "draft_model", "model": "/nonexistent", "num_speculative_tokens": 2,
            "draft_tensor_parallel_size": 2}
    rc = main(["generate", "hi", "--speculative-config", json.dumps(spec)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "draft_tensor_parallel_size=2" in err and "Traceback" not in err


@pytest.fixture
def captured_config(monkeypatch: pytest.MonkeyPatch) -> list[EngineConfig]:
    """LLM's engine builder replaced by one that records the config it is given."""
    seen: list[EngineConfig] = []

    def fake_build(config: EngineConfig, loaded: object) -> object:
        seen.append(config)
        return object()

    monkeypatch.setattr(llm_module, "build_offline_engine", fake_build)
    return seen


@pytest.mark.parametrize("value", [KEYS, json.dumps(KEYS), EXPECTED],
                         ids=["dict", "json", "SpeculativeConfig"])
def test_llm_takes_dict_json_or_config(value: object,
                                       captured_config: list[EngineConfig]) -> None:
    llm = llm_module.LLM(model="unused", speculative_config=value)
    assert llm.config.speculative_config == EXPECTED
    assert captured_config == [llm.config]


def test_llm_default_is_off(captured_config: list[EngineConfig]) -> None:
    assert llm_module.LLM(model="unused").config.speculative_config is None


@pytest.mark.parametrize("value, words", [
    (5, ["speculative_config must be", "got int"]),
    ([("method", "ngram")], ["speculative_config must be", "got list"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "acceptance_method": "typical"},
     ["speculative_config:", "acceptance_method"]),
    ('{"method": "eagle3", "num_speculative_tokens": 3}', ["speculative_config:", "model"]),
])
def test_llm_refuses_naming_the_argument(value: object, words: list[str],
                                         captured_config: list[EngineConfig]) -> None:
    with pytest.raises(ValueError) as exc:
        llm_module.LLM(model="unused", speculative_config=value)
    for w in words:
        assert w in str(exc.value)
    assert captured_config == []


def test_per_request_opt_out_on_the_cli_and_batch_lines() -> None:
    from jaxserve.cli.batch_io import LineRequest, parse_line

    # `--no-speculative`: the sampling registry's flag (generate, client; batch's default).
    args = build_parser().parse_args(["generate", "hi", "--no-speculative"])
    assert flags.sampling_params_from_args(args).speculative is False
    args = build_parser().parse_args(["generate", "hi"])
    assert flags.sampling_params_from_args(args).speculative is True
    line = parse_line('{"id": "a", "prompt": "x", "speculative": false}', 1, {})
    assert isinstance(line, LineRequest) and line.params.speculative is False
    # A line's own value wins over the command's default.
    line = parse_line('{"id": "a", "prompt": "x", "speculative": true}', 1,
                      {"speculative": False})
    assert isinstance(line, LineRequest) and line.params.speculative is True
    bad = parse_line('{"id": "a", "prompt": "x", "speculative": "no"}', 1, {})
    assert not isinstance(bad, LineRequest) and "speculative" in bad.record()["error"]
