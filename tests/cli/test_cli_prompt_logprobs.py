"""--prompt-logprobs on the command line: `jaxserve generate` and `jaxserve client` print the
prompt's logprobs after the completion, `jaxserve batch` writes them into each output line.
Oracle: the engine's own RequestOutput for the same prompt (greedy) on the same tiny model,
saved as a checkpoint the commands load."""

from __future__ import annotations

import pathlib
import re

import pytest
from support.engine_fixtures import VOCAB, tiny_engine, tiny_logprob_atol, tiny_model
from support.hf_models import save_tiny_tokenizer
from support.jsonl import read_jsonl, write_jsonl

from jaxserve import SamplingParams, cli
from jaxserve.cli.prompt_logprobs import format_prompt_logprobs
from jaxserve.server.background import BackgroundServer
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel

# One token bucket, as FLAGS: the served engine's warmup compiles 5 executables, not 21.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, max_model_len=64,
              attention_impl="reference", token_buckets=(32,))
FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--page-size", "8",
         "--max-model-len", "64", "--kv-cache-memory", "1MiB", "--attention-impl", "reference",
         "--token-buckets", "32", "--temperature", "0"]
PROMPT = "w5 w9 w33 w7"
LINE = re.compile(r"^  (\d+)(?: '[^']*')?\s+(-?\d+\.\d+)(?:  top: (.*))?$")


def test_format_prompt_logprobs() -> None:
    text = format_prompt_logprobs([5, 6], [None, {6: -3.5, 12: -1.25, 7: -2.0}], 2,
                                  lambda t: f"w{t}")
    assert text.splitlines() == ["prompt logprobs (token, logprob, top-N):", "  5 'w5'",
                                 "  6 'w6'    -3.5000  top: 12 'w12' -1.2500, 7 'w7' -2.0000"]
    assert format_prompt_logprobs([5], None, 2).endswith("none came back")
    assert format_prompt_logprobs([5, 6], [None, {6: -0.5}], 0).splitlines()[-1] == \
        "  6    -0.5000"


def _oracle(prompt: str | list[int], n: int):  # noqa: ANN202 - a RequestOutput
    engine = tiny_engine(warmup=False, **ENGINE)
    engine.add_request("o", prompt, SamplingParams(max_tokens=0, prompt_logprobs=n))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    assert final is not None and final.prompt_logprobs is not None
    return final


def _check_printed(stdout: str, want) -> None:  # noqa: ANN001 - a RequestOutput
    lines = stdout.splitlines()
    start = lines.index("prompt logprobs (token, logprob, top-N):")
    rows = lines[start + 1:]
    assert len(rows) == len(want.prompt_token_ids)
    for row, tid, entry in zip(rows[1:], want.prompt_token_ids[1:], want.prompt_logprobs[1:]):
        m = LINE.match(row)
        assert m is not None, row
        assert int(m.group(1)) == tid
        # Printed to 4 decimals (0.5e-4 of rounding) from another layout of the test model
        # (tiny_logprob_atol, derived from its weights).
        assert float(m.group(2)) == pytest.approx(entry[tid], abs=tiny_logprob_atol() + 0.5e-4)
        top = [int(t.split()[0]) for t in m.group(3).split(", ")]
        assert top == [t for t, _ in sorted(entry.items(), key=lambda kv: -kv[1])[:2]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from jaxserve.models.hf_loader import save_hf_dir

    model = tiny_model()
    d = tmp_path_factory.mktemp("model")
    save_hf_dir(d, model.config, model.params)
    save_tiny_tokenizer(d, VOCAB)
    return d


def test_generate_prints_prompt_logprobs(model_dir: pathlib.Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("JAXSERVE_COMPILATION_CACHE_DIR", "")
    assert cli.main(["generate", PROMPT, "--model", str(model_dir), "--max-tokens", "0",
                     "--prompt-logprobs", "2", *FLAGS]) == 0
    _check_printed(capsys.readouterr().out, _oracle(PROMPT, 2))


def test_batch_writes_prompt_logprobs(model_dir: pathlib.Path, tmp_path: pathlib.Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXSERVE_COMPILATION_CACHE_DIR", "")
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": PROMPT, "max_tokens": 0, "prompt_logprobs": 2},
        {"id": "b", "prompt": PROMPT, "max_tokens": 1}])
    out = tmp_path / "out.jsonl"
    assert cli.main(["batch", str(src), str(out), "--model", str(model_dir), "--no-progress",
                     *FLAGS]) == 0
    a, b = read_jsonl(out)
    want = _oracle(PROMPT, 2)
    assert a["text"] == "" and a["completion_tokens"] == 0 and a["finish_reason"] == "length"
    assert a["prompt_logprobs"][0] is None
    assert len(a["prompt_logprobs"]) == len(want.prompt_token_ids)
    for got, entry in zip(a["prompt_logprobs"][1:], want.prompt_logprobs[1:]):
        assert list(got) == [str(t) for t in entry]  # JSON keys: the prompt token first
        assert list(got.values()) == pytest.approx(list(entry.values()),
                                                   abs=tiny_logprob_atol())  # JSON: exact
    assert "prompt_logprobs" not in b


def test_client_prints_prompt_logprobs(capsys: pytest.CaptureFixture[str]) -> None:
    srv = BackgroundServer(ServerConfig(port=0, http_port=None),
                           lambda: ServedModel(tiny_engine(**ENGINE), "tiny", "hf")).start()
    try:
        assert cli.main(["client", PROMPT, "--target", srv.target, "--max-tokens", "0",
                         "--prompt-logprobs", "2"]) == 0
    finally:
        srv.stop()
    out = capsys.readouterr().out
    assert out.startswith("\nprompt logprobs")  # no completion text, then the table
    _check_printed(out, _oracle(PROMPT, 2))
