"""`jaxserve batch`: line validation, ordering, error lines in place, resume after a crash, and
the command end to end. Host logic runs on the arithmetic fake runner (no model); greedy texts
are checked against the full-sequence `rollout` oracle on a tiny random model."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from support.engine_fixtures import (VOCAB, rollout, tiny_engine, tiny_model, tiny_model_config,
                             tiny_tokenizer)
from support.hf_models import save_tiny_tokenizer
from support.jsonl import read_jsonl, write_jsonl

from jaxserve import SamplingParams, cli
from jaxserve.cli.batch_io import (LineError, LineRequest, OrderedSink, ResultWriter, parse_line,
                                   recover_output)
from jaxserve.cli.batch_job import BatchOptions
from jaxserve.cli.batch_job import main as batch_main
from jaxserve.cli.batch_job import run_batch
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.fake_runner import ArithmeticRunner
from jaxserve.engine.sizing import plan_engine


# ----------------------------------------------------------------------------- helpers
def fake_engine(**cfg: object) -> Engine:
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=128,
                attention_impl="reference")
    base.update(cfg)
    config = EngineConfig(**base)  # type: ignore[arg-type]
    plan = plan_engine(config, tiny_model_config(), 4, 1 << 30)
    return Engine(config, plan, ArithmeticRunner(VOCAB), tiny_tokenizer(), (2,))


def count_adds(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Record (engine request id, prompt length) of every add_request."""
    added: list[tuple[str, int]] = []
    real = engine.add_request

    def add(rid: str, prompt: Any, params: Any = None, **kw: Any) -> None:
        real(rid, prompt, params, **kw)
        added.append((rid, len(getattr(prompt, "token_ids", prompt))))  # ids or Admitted

    monkeypatch.setattr(engine, "add_request", add)
    return added


def one_by_one(engine: Engine, prompt: Any, params: SamplingParams) -> tuple[str, int]:
    """Oracle on the same runner: one request alone in the engine."""
    engine.add_request("oracle", prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None
    return final.outputs[0].text, len(final.outputs[0].token_ids)


def no_bar(**kw: Any) -> BatchOptions:
    return BatchOptions(progress=False, **kw)


def strip_cache(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "cached_prompt_tokens"} for r in recs]


# ----------------------------------------------------------------------------- parsing
def test_parse_valid_lines_and_defaults() -> None:
    r = parse_line('{"id": "a", "prompt": "w5 w6", "max_tokens": 3}', 1, {"temperature": 0.0,
                                                                         "max_tokens": 9})
    assert isinstance(r, LineRequest)
    assert (r.id, r.prompt, r.params.max_tokens, r.params.temperature) == ("a", "w5 w6", 3, 0.0)
    r = parse_line('{"id": 7, "prompt": [5, 6], "stop": ["w9"], "n": 2}', 2)
    assert isinstance(r, LineRequest) and r.id == 7 and r.params.stop == ("w9",)
    r = parse_line('{"id": "c", "messages": [{"role": "user", "content": "hi"}]}', 3)
    assert isinstance(r, LineRequest) and r.messages and r.prompt is None


@pytest.mark.parametrize("text,has_id,match", [
    ('{"id": "a", "prompt": "w5"', False, "invalid JSON"),
    ('[1, 2]', False, "JSON object"),
    ('{"prompt": "w5"}', False, "missing 'id'"),
    ('{"id": null, "prompt": "w5"}', False, "id=None"),
    ('{"id": true, "prompt": "w5"}', False, "id=True"),
    ('{"id": "", "prompt": "w5"}', False, "id=''"),
    ('{"id": "a", "prompt": "w5", "max_tokenz": 3}', True, "unknown key 'max_tokenz'"),
    ('{"id": "a", "prompt": "w5", "messages": []}', True, "not both"),
    ('{"id": "a"}', True, "exactly one of 'prompt' and 'messages'"),
    ('{"id": "a", "prompt": 5}', True, "prompt must be"),
    ('{"id": "a", "prompt": [5, "x"]}', True, "prompt must be"),
    ('{"id": "a", "messages": "hi"}', True, "messages must be"),
    ('{"id": "a", "prompt": "w5", "temperature": -1}', True, "temperature=-1"),
    ('{"id": "a", "prompt": "w5", "max_tokens": -1}', True, "max_tokens=-1"),
    ('{"id": "a", "prompt": "w5", "stop": 5}', True, "stop"),
    # Values Python's json parses into exceptions other than JSONDecodeError / ValueError:
    ('{"id": "a", "prompt": "w5", "temperature": 1' + "0" * 400 + '}', True,
     "temperature=1000"),  # an int too large for a float: OverflowError in isfinite
    ('{"id": "a", "prompt": "w5", "seed": ' + "9" * 5000 + '}', False, "invalid JSON"),
    ("[" * 100_000 + "]" * 100_000, False, "invalid JSON"),  # RecursionError
    ('{"id": "a", "prompt": "w5", "ignore_eos": "no"}', True, "ignore_eos='no' must be true"),
])
def test_parse_errors_name_the_problem(text: str, has_id: bool, match: str) -> None:
    r = parse_line(text, 4)
    assert isinstance(r, LineError) and match in r.error
    rec = r.record()
    assert rec["id"] == ("a" if has_id else None)
    assert ("line" in rec) == (not has_id) and rec.get("line", 4) == 4


# ----------------------------------------------------------------------------- resume / writer
def test_recover_cuts_partial_last_line_and_counts_done(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out.jsonl"
    good = b'{"id": "a", "text": "x"}\n{"id": null, "error": "bad", "line": 2}\n' \
           b'{"id": 3, "error": "e"}\n'
    for tail in (b'{"id": "d", "te', b'{"id": "d", "te\n', b"garbage\n"):
        out.write_bytes(good + tail)
        st = recover_output(out)
        assert out.read_bytes() == good and st.truncated_bytes == len(tail)
        assert st.occurrence_done("a", 1) and not st.occurrence_done("a", 2)
        assert st.occurrence_done(3, 1) and not st.occurrence_done("3", 1)
        assert not st.occurrence_done("d", 1) and st.done_lines == {2}
    st = recover_output(out, retry_errors=True)  # error records go: those lines run again
    assert out.read_bytes() == b'{"id": "a", "text": "x"}\n'
    assert st.dropped_errors == 2 and st.done_lines == set()
    assert recover_output(tmp_path / "missing.jsonl").records == 0


def test_ordered_sink_writes_contiguous_prefix(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "o.jsonl"
    with ResultWriter(out, fsync_interval=0) as w:
        sink = OrderedSink(w)
        sink.put(3, {"id": 3})
        sink.put(2, None)
        assert out.read_bytes() == b"" and sink.buffered == 2
        sink.put(1, {"id": "é"})
        assert read_jsonl(out) == [{"id": "é"}, {"id": 3}] and sink.buffered == 0
        with pytest.raises(ValueError):
            sink.put(2, {"id": 2})


# ----------------------------------------------------------------------------- on the fake runner
def test_empty_inputs_get_admissions_text(tmp_path: pathlib.Path) -> None:
    """Emptiness is admission's check (parse_line checks JSON shapes only): the error lines
    carry the very text the offline API raises."""
    engine = fake_engine()
    lines = [{"id": "e1", "prompt": ""}, {"id": "e2", "prompt": []}, {"id": "e3", "messages": []}]
    out = tmp_path / "out.jsonl"
    run_batch(engine, write_jsonl(tmp_path / "in.jsonl", lines), out, no_bar())
    got = [r["error"] for r in read_jsonl(out)]
    want = []
    for prompt in ("", []):
        with pytest.raises(ValueError) as e:
            engine.admit(prompt, SamplingParams())
        want.append(str(e.value))
    assert got == want + ["messages must not be empty"]
    assert want == ["prompt must not be empty", "prompt_token_ids must not be empty"]


def mixed_lines() -> list[Any]:
    lines: list[Any] = []
    for i in range(12):
        lines.append({"id": f"q{i}", "prompt": " ".join(f"w{5 + (i * 7 + j) % 150}"
                                                      for j in range(1 + (i * 5) % 17)),
                      "max_tokens": 1 + i % 5, "ignore_eos": True})
    lines[3] = {"id": "q3", "prompt": [7] * 300, "max_tokens": 2}  # too long for 128
    lines[5] = "{not json"
    lines[7] = {"id": "q1", "prompt": "w5"}  # duplicate of line 2
    lines.insert(9, "")  # blank line: ignored
    lines.insert(10, {"id": "q-bad", "prompt": "w5", "temperature": -2})
    lines.append({"id": "q-vocab", "prompt": [5, VOCAB + 3]})
    lines.append({"id": "q-unknown", "prompt": "w5", "colour": "red"})
    lines.append({"id": 99, "prompt": [9, 10, 11], "max_tokens": 4, "ignore_eos": True})
    return lines


def test_fake_runner_order_errors_in_place_and_oracle(tmp_path: pathlib.Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lines = mixed_lines()
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    engine = fake_engine()
    added = count_adds(engine, monkeypatch)
    s = run_batch(engine, src, out, no_bar(window=4, defaults={"temperature": 0.0}))
    recs = read_jsonl(out)
    expected_ids = [None if isinstance(x, str) else x["id"] for x in lines if x != ""]
    assert [r["id"] for r in recs] == expected_ids
    by_line = [x for x in lines if x != ""]
    oracle_engine = fake_engine()
    errors = {}
    for x, r in zip(by_line, recs):
        if "error" in r:
            errors[r["id"]] = r
            continue
        params = SamplingParams(**{k: v for k, v in x.items() if k not in ("id", "prompt")},
                                temperature=0.0)
        text, n = one_by_one(oracle_engine, x["prompt"], params)
        assert (r["text"], r["completion_tokens"]) == (text, n) and n == params.max_tokens
        assert r["finish_reason"] == "length"
        ids = x["prompt"] if isinstance(x["prompt"], list) else tiny_tokenizer().encode(
            x["prompt"])
        assert r["prompt_tokens"] == len(ids) and r["cached_prompt_tokens"] >= 0
    assert "max_model_len=128" in errors["q3"]["error"]
    assert errors[None] == {"id": None, "error": errors[None]["error"], "line": 6}
    assert "duplicate id 'q1'" in errors["q1"]["error"]
    assert "temperature=-2" in errors["q-bad"]["error"]
    assert "outside the vocabulary" in errors["q-vocab"]["error"]
    assert "'colour'" in errors["q-unknown"]["error"]
    assert (s.lines, s.ok, s.errors, s.skipped) == (16, 10, 6, 0)
    assert s.output_tokens == sum(r.get("completion_tokens", 0) for r in recs)
    # Longest prompt first within each window of 4 lines (the too-long one failed at add).
    windows: dict[int, list[int]] = {}
    for rid, n in added:
        windows.setdefault((int(rid.split("-")[1]) - 1) // 4, []).append(n)
    assert all(v == sorted(v, reverse=True) for v in windows.values())
    assert not engine.has_unfinished()


def test_engine_kept_fed_across_windows(tmp_path: pathlib.Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": i, "prompt": [5 + i % 50] * (3 + i % 4), "max_tokens": 6, "ignore_eos": True}
        for i in range(40)])
    engine = fake_engine(max_num_seqs=4)
    sizes: list[int] = []
    real_step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (sizes.append(engine.num_requests),
                                                 real_step())[1])
    s = run_batch(engine, src, tmp_path / "out.jsonl", no_bar(window=5))
    assert s.ok == 40
    # The batch never runs short until the input is used up: no drain between windows.
    first_short = next((i for i, n in enumerate(sizes) if n < 4), len(sizes))
    assert all(n < 4 for n in sizes[first_short:]) and len(sizes) - first_short <= 6
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == list(range(40))


def test_resume_after_crash_redoes_only_missing_lines(tmp_path: pathlib.Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lines = mixed_lines()
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    full = tmp_path / "full.jsonl"
    run_batch(fake_engine(), src, full, no_bar(window=4, defaults={"temperature": 0.0}))
    full_bytes = full.read_bytes().splitlines(keepends=True)
    # A crash after 7 records, in the middle of writing the 8th.
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"".join(full_bytes[:7]) + full_bytes[7][:20])
    engine = fake_engine()
    added = count_adds(engine, monkeypatch)
    s = run_batch(engine, src, out, no_bar(window=4, defaults={"temperature": 0.0}))
    assert strip_cache(read_jsonl(out)) == strip_cache(read_jsonl(full))
    done_ids = {json.loads(b)["id"] for b in full_bytes[:7]}
    redo = {r["id"] for r in read_jsonl(full)[7:] if "error" not in r}
    added_lines = {int(rid.split("-")[1]) for rid, _ in added}
    added_ids = {lines[i - 1]["id"] for i in added_lines}
    assert added_ids == redo and not added_ids & done_ids
    assert s.skipped == 7 and s.ok + s.errors == 16 - 7
    # Everything done: a third run adds nothing and writes nothing.
    before = out.read_bytes()
    added.clear()
    s = run_batch(engine, src, out, no_bar())
    assert added == [] and out.read_bytes() == before and s.skipped == 16


def test_retry_errors_reruns_error_lines(tmp_path: pathlib.Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": [5] * 10, "max_tokens": 2},
        {"id": "long", "prompt": [6] * 100, "max_tokens": 60, "ignore_eos": True},
        {"id": "c", "prompt": [7] * 3, "max_tokens": 2}])
    out = tmp_path / "out.jsonl"
    run_batch(fake_engine(max_model_len=64), src, out, no_bar())
    assert "error" in read_jsonl(out)[1]
    s = run_batch(fake_engine(max_model_len=256), src, out, no_bar())  # errors count as done
    assert s.skipped == 3 and len(read_jsonl(out)) == 3
    s = run_batch(fake_engine(max_model_len=256), src, out, no_bar(retry_errors=True))
    assert (s.skipped, s.ok) == (2, 1)
    recs = read_jsonl(out)
    assert [r["id"] for r in recs] == ["a", "c", "long"] and recs[2]["completion_tokens"] == 60


def test_n_samples_and_logprobs_shape(tmp_path: pathlib.Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "n2", "prompt": "w5 w6", "n": 2, "max_tokens": 3, "ignore_eos": True},
        {"id": "lp", "prompt": "w5 w6", "max_tokens": 2, "logprobs": 1, "ignore_eos": True}])
    run_batch(fake_engine(), src, tmp_path / "out.jsonl", no_bar())
    n2, lp = read_jsonl(tmp_path / "out.jsonl")
    assert isinstance(n2["text"], list) and len(n2["text"]) == 2
    assert n2["finish_reason"] == ["length", "length"] and n2["completion_tokens"] == 6
    assert isinstance(lp["text"], str) and len(lp["logprobs"]) == 2


# ----------------------------------------------------------------------------- on a tiny model
@pytest.fixture(scope="module")
def model_engine() -> Engine:
    return tiny_engine(warmup=False, max_num_seqs=4, max_num_batched_tokens=32,
                       max_model_len=64, token_buckets=(8, 32))


def test_greedy_texts_equal_rollout_and_chat(tmp_path: pathlib.Path,
                                             model_engine: Engine) -> None:
    model = tiny_model()
    tok = model.tokenizer
    chat = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w11 w12"}]
    lines = [{"id": "s", "prompt": "w5 w9 w33 w7", "max_tokens": 5},
             {"id": "t", "prompt": [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 7},
             {"id": "chat", "messages": chat, "max_tokens": 4},
             {"id": "short", "prompt": [42]},
             {"id": "long", "prompt": [8] * 70}]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    s = run_batch(model_engine, src, tmp_path / "out.jsonl",
                  no_bar(defaults={"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}))
    recs = read_jsonl(tmp_path / "out.jsonl")
    assert [r["id"] for r in recs] == ["s", "t", "chat", "short", "long"]
    prompts = [tok.encode("w5 w9 w33 w7"), lines[1]["prompt"],
               tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True), [42]]
    for r, ids, n in zip(recs, prompts, (5, 7, 4, 3)):
        expected = rollout(model, list(ids), n)
        assert r["text"] == tok.decode(expected), r["id"]
        assert (r["prompt_tokens"], r["completion_tokens"]) == (len(ids), n)
    assert "max_model_len=64" in recs[4]["error"] and (s.ok, s.errors) == (4, 1)


# ----------------------------------------------------------------------------- command line
def test_cli_end_to_end_with_saved_checkpoint(tmp_path: pathlib.Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from jaxserve.models.hf_loader import save_hf_dir

    monkeypatch.setenv("JAXSERVE_COMPILATION_CACHE_DIR", "")
    model = tiny_model()
    d = tmp_path / "model"
    save_hf_dir(d, model.config, model.params)
    save_tiny_tokenizer(d, VOCAB)
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "w5 w6 w7", "ignore_eos": True},
        {"id": "b", "prompt": [9, 8, 7, 6], "max_tokens": 2, "ignore_eos": True},
        {"id": "c", "prompt": "w5", "top_k": 500}])  # over the vocabulary
    out = tmp_path / "out.jsonl"
    flags = ["--model", str(d), "--max-tokens", "4", "--temperature", "0", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "32", "--page-size", "8", "--max-model-len", "64",
             "--kv-cache-memory", "1MiB", "--attention-impl", "reference",
             "--token-buckets", "32", "--no-progress"]
    assert cli.main(["batch", str(src), str(out), *flags]) == 0
    recs = read_jsonl(out)
    tok = model.tokenizer
    assert recs[0]["text"] == tok.decode(rollout(model, tok.encode("w5 w6 w7"), 4))
    assert recs[1]["text"] == tok.decode(rollout(model, [9, 8, 7, 6], 2))
    assert recs[2]["id"] == "c" and "top_k=500 must be -1 or 0 (disabled) or in [1, " in \
        recs[2]["error"]
    err = capsys.readouterr().err
    assert "3 lines: 2 ok, 1 errors, 0 skipped" in err and "tok/s" in err
    # Unusable arguments exit 2 with one line, before any model is loaded.
    assert cli.main(["batch", str(tmp_path / "missing.jsonl"), str(out), *flags]) == 2
    assert batch_main([str(src), str(out), *flags, "--max-tokens", "-1"]) == 2
    assert batch_main([str(src), str(src), *flags]) == 2
    assert batch_main([str(src), str(out), *flags, "--window", "0"]) == 2
    err = capsys.readouterr().err
    assert "missing.jsonl" in err and "max_tokens=-1" in err and "different files" in err
