"""The sampling registry (`jaxserve.engine.sampling_params`) and every place derived from it.

Each field must reach the proto, the HTTP body, the CLI flags and (device fields) the step's
sampling matrix from its one declaration: a field that one of them drops, or maps to a
different value, fails here. `VALUES` must name every field, so a new knob fails the first
test until it gets a non-default test value (and then every round trip covers it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest

from jaxserve.engine import sampling_params as sp_mod
from jaxserve.engine.batch import (BIAS_PAD_ID, BatchShape, build_batch, leaves, pad_bias,
                                   parts)
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.engine.structured_outputs import StructuredOutputs

# A non-default value of every field; floats exact in float32 (the proto's float).
VALUES = dict(n=3, temperature=0.75, top_p=0.5, top_k=7, min_p=0.125, seed=2**63 + 5,
              max_tokens=40, min_tokens=2, stop=("xy", "z"), stop_token_ids=(4, 9),
              ignore_eos=True, logprobs=3, repetition_penalty=1.25, presence_penalty=-0.5,
              frequency_penalty=0.25, prompt_logprobs=2, include_stop_str_in_output=True,
              skip_special_tokens=False, logit_bias=((3, 0.5), (9, -100.0)),
              structured_outputs=StructuredOutputs(json={"type": "object", "properties": {
                  "a": {"enum": ["x", 1]}}}),
              allowed_token_ids=(3, 5, 9), bad_words=("w7", "w8 w9"), truncate_prompt_tokens=4,
              speculative=False)
FULL = SamplingParams(**VALUES)


def test_values_cover_every_field_with_a_non_default() -> None:
    assert list(VALUES) == [f.name for f in sp_mod.FIELDS]
    for f in sp_mod.FIELDS:
        assert VALUES[f.name] != f.default, f.name


def test_registry_matches_the_dataclass_and_the_device_columns() -> None:
    assert [f.name for f in sp_mod.FIELDS] == [f.name for f in dataclasses.fields(SamplingParams)]
    assert sp_mod.DEVICE_FIELDS == tuple(f.name for f in sp_mod.FIELDS if f.device)
    assert len(sp_mod.PAD_ROW) == len(sp_mod.DEVICE_FIELDS)
    # The padding row is the defaults' row except for sampling: greedy, and no logprobs.
    row = dict(zip(sp_mod.DEVICE_FIELDS, SamplingParams().row))
    pad = dict(zip(sp_mod.DEVICE_FIELDS, sp_mod.PAD_ROW))
    assert pad == {**row, "temperature": 0.0}
    assert dict(zip(sp_mod.DEVICE_FIELDS, FULL.row)) == {
        name: float(VALUES[name]) for name in sp_mod.DEVICE_FIELDS}
    assert SamplingParams(logprobs=0).row[sp_mod.DEVICE_COLUMN["logprobs"]] == 0.0
    assert SamplingParams().row[sp_mod.DEVICE_COLUMN["logprobs"]] < 0  # None: no logprobs


def test_uses_penalties_comes_from_the_penalty_columns() -> None:
    assert not SamplingParams().uses_penalties
    penalties = [f.name for f in sp_mod.DEVICE if f.device.penalty]
    assert penalties == ["repetition_penalty", "presence_penalty", "frequency_penalty"]
    for name in penalties:
        assert SamplingParams(**{name: VALUES[name]}).uses_penalties


def test_one_max_logprobs() -> None:
    from jaxserve.device import sampler
    from jaxserve.engine import runner

    assert not hasattr(runner, "MAX_LOGPROBS")
    assert sampler.MAX_LOGPROBS is sp_mod.MAX_LOGPROBS
    with pytest.raises(ValueError, match=r"logprobs=21 must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=sp_mod.MAX_LOGPROBS + 1)


# ------------------------------------------------------------------------------ proto
@pytest.mark.parametrize("params", [FULL, SamplingParams(), SamplingParams(max_tokens=None),
                                    SamplingParams(stop="x", logprobs=0, top_k=1)],
                         ids=["every-field", "defaults", "no-max-tokens", "edge"])
def test_proto_round_trip(params: SamplingParams) -> None:
    from jaxserve.server.client import sampling_to_proto
    from jaxserve.server.proto_map import sampling_from_proto

    assert sampling_from_proto(sampling_to_proto(params)) == params


def test_proto_fields_are_the_registry_fields() -> None:
    from jaxserve.server.client import pb2

    assert sorted(f.name for f in pb2.SamplingParams.DESCRIPTOR.fields) == \
        sorted(f.name for f in sp_mod.FIELDS)


def test_unset_proto_fields_take_the_grpc_defaults() -> None:
    from jaxserve.server.client import pb2
    from jaxserve.server.proto_map import sampling_from_proto

    assert sampling_from_proto(pb2.SamplingParams()) == SamplingParams(max_tokens=None)


@pytest.mark.parametrize("name", [f.name for f in sp_mod.FIELDS
                                  if isinstance(f.rule, sp_mod.Finite)])
def test_proto_non_finite_message_names_the_range(name: str) -> None:
    from jaxserve.server.client import pb2
    from jaxserve.server.proto_map import InvalidRequest, error_message, sampling_from_proto

    msg = pb2.SamplingParams(**{name: float("nan")})
    want = f"sampling.{name}=nan must be a finite number {sp_mod.BY_NAME[name].rule.text}"
    with pytest.raises(InvalidRequest) as e:
        sampling_from_proto(msg)
    assert error_message(e.value) == want  # the gRPC front's text names the range


# ------------------------------------------------------------------------------ HTTP
def test_http_body_round_trip() -> None:
    from jaxserve.server.openai_schema import parse_completion

    body = {k: list(v) if isinstance(v, tuple) else v for k, v in VALUES.items()}
    body["logit_bias"] = {str(t): b for t, b in VALUES["logit_bias"]}  # JSON keys are strings
    body["structured_outputs"] = VALUES["structured_outputs"].as_mapping()  # a JSON object
    assert parse_completion({"prompt": "w5", **body}).params == FULL
    # Front defaults: max_tokens 16 when absent, null = up to max_model_len; top_k 0 = off.
    assert parse_completion({"prompt": "w5"}).params == SamplingParams()
    assert parse_completion({"prompt": "w5", "max_tokens": None}).params.max_tokens is None
    # top_k 0 is "off" like -1 everywhere (the sampler reads k <= 0 as the whole vocabulary).
    assert parse_completion({"prompt": "w5", "top_k": 0}).params.top_k == 0


@pytest.mark.parametrize("name,bad,message", [
    ("ignore_eos", 1, "ignore_eos=1 must be a boolean"),
    ("stop", 5, "stop must be a string or a list of strings"),
    ("stop", ["a", 1], "stop must be a string or a list of strings"),
    ("stop_token_ids", 3, "stop_token_ids must be a list of token ids"),
    ("logit_bias", [[5, 1.0]], f"logit_bias must be {sp_mod.BY_NAME['logit_bias'].rule.text}"),
])
def test_http_type_checks_from_the_declared_types(name: str, bad: object, message: str) -> None:
    from jaxserve.server.openai_schema import ApiError, parse_completion

    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": "w5", name: bad})
    assert e.value.message == message and e.value.body["error"]["param"] == name


# ------------------------------------------------------------------------------ CLI
def _argv(values: dict) -> list[str]:
    argv = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + name.replace("_", "-"))
        elif name == "logit_bias":
            for k, v in value:
                argv += [flag, f"{k}={v}"]
        elif isinstance(value, StructuredOutputs):
            argv += [flag, json.dumps(value.as_mapping())]
        elif isinstance(value, tuple):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, str(value)]
    return argv


def test_cli_flags_round_trip() -> None:
    from jaxserve.cli import flags

    p = argparse.ArgumentParser()
    flags.add_sampling_flags(p)
    assert flags.sampling_params_from_args(p.parse_args(_argv(VALUES))) == FULL
    assert flags.sampling_params_from_args(p.parse_args([])) == SamplingParams()
    lines = argparse.ArgumentParser()
    flags.add_sampling_flags(lines, for_lines=True)
    assert flags.sampling_kwargs_from_args(lines.parse_args([])) == {}
    got = flags.sampling_kwargs_from_args(lines.parse_args(_argv(VALUES)))
    spec = StructuredOutputs.from_mapping(got["structured_outputs"])  # the flag's JSON object
    assert {**got, "structured_outputs": spec} == VALUES


def test_command_sampling_flags_keep_their_defaults() -> None:
    from jaxserve.cli import flags
    from jaxserve.cli.main import build_parser

    p = build_parser()
    gen = p.parse_args(["generate", "hi"])
    assert flags.sampling_params_from_args(gen) == SamplingParams(max_tokens=64, temperature=0.0,
                                                                  seed=0)
    assert gen.seed == 0  # also the engine's seed
    client = p.parse_args(["client", "hi", "--stop", "a", "--stop", "b", "--top-k", "5"])
    assert flags.sampling_params_from_args(client) == SamplingParams(
        max_tokens=64, temperature=0.0, stop=("a", "b"), top_k=5)
    batch = p.parse_args(["batch", "in", "out", "--temperature", "0", "--seed", "3"])
    assert flags.sampling_kwargs_from_args(batch) == {"temperature": 0.0}
    assert batch.engine_seed == 3


def test_batch_line_keys_are_the_registry_fields() -> None:
    from jaxserve.cli.batch_io import SAMPLING_KEYS

    assert SAMPLING_KEYS == {f.name for f in sp_mod.FIELDS}


# ------------------------------------------------------------------------------ step arrays
def test_build_batch_rows_and_padding_follow_the_registry() -> None:
    shape = BatchShape(buckets=((8, 4),), page_size=4, max_pages_per_seq=2, vocab_size=64,
                       history_len=8)
    seqs = []
    for i, params in enumerate((FULL, SamplingParams())):
        req = Sequence(f"r{i}", [1, 2, 3], params, (0,), 0.0, pages=[1 + i])
        seqs.append(ScheduledSeq(req, start=0, num_new_tokens=3, samples=True))
    b = build_batch(SchedulerOutput(seqs, 6, []), shape)
    knobs = b.sampling.knobs
    assert knobs.dtype == np.float32 and knobs.shape == (4, len(sp_mod.DEVICE_FIELDS))
    np.testing.assert_array_equal(knobs[0], np.float32(FULL.row))
    np.testing.assert_array_equal(knobs[1], np.float32(SamplingParams().row))
    np.testing.assert_array_equal(knobs[2:], np.float32([sp_mod.PAD_ROW] * 2))
    assert b.penalties.history.shape == (4, 8)  # FULL has penalties
    # logit_bias: FULL's entries in row 0, then (BIAS_PAD_ID, 0.0) padding (an id the
    # sampler drops); other rows all padding.
    n = len(FULL.logit_bias)
    bias = b.bias
    assert bias.ids.shape == bias.values.shape == (4, sp_mod.MAX_LOGIT_BIAS)
    assert bias.ids.dtype == np.int32 and bias.values.dtype == np.float32
    np.testing.assert_array_equal(bias.ids[0, :n], [t for t, _ in VALUES["logit_bias"]])
    np.testing.assert_array_equal(bias.values[0, :n], [v for _, v in VALUES["logit_bias"]])
    assert (bias.ids[0, n:] == BIAS_PAD_ID).all() and not bias.values[0, n:].any()
    assert (bias.ids[1:] == BIAS_PAD_ID).all() and not bias.values[1:].any()
    assert BIAS_PAD_ID >= 2**31 - 1  # outside any vocabulary
    # A step where no row has a bias sends no bias arrays at all (width 0).
    plain = build_batch(SchedulerOutput(seqs[1:], 3, []), shape)
    assert plain.bias.ids.shape == plain.bias.values.shape == (4, 0)
    # No knob has a StepBatch array of its own: they travel in the matrix.
    arrays = {field for _, part in parts(b) for field, _ in leaves(part)}
    assert not arrays & set(sp_mod.DEVICE_FIELDS)


def test_build_batch_reads_each_requests_bias_packed_once() -> None:
    shape = BatchShape(buckets=((8, 4),), page_size=4, max_pages_per_seq=2, vocab_size=64,
                       history_len=8)
    req = Sequence("r", [1, 2, 3], FULL, (0,), 0.0, pages=[1])
    ids, values = req.logit_bias_arrays
    assert ids.dtype == np.int32 and values.dtype == np.float32
    np.testing.assert_array_equal(ids, [t for t, _ in VALUES["logit_bias"]])
    np.testing.assert_array_equal(values, [v for _, v in VALUES["logit_bias"]])
    assert req.logit_bias_arrays is req.logit_bias_arrays  # memoised on the request
    # The step reads the request's packed row, not the SamplingParams tuples: a stand-in
    # cached row is what lands in the batch.
    req.__dict__["logit_bias_arrays"] = (np.array([7], np.int32), np.array([1.5], np.float32))
    b = build_batch(SchedulerOutput([ScheduledSeq(req, 0, 3, True)], 3, []), shape)
    assert b.bias.ids[0, :2].tolist() == [7, BIAS_PAD_ID]
    assert b.bias.values[0, :2].tolist() == [1.5, 0.0]


def test_empty_batch_and_multihost_lists_are_derived() -> None:
    from jaxserve.device import multihost
    from jaxserve.device.model_runner import empty_batch

    shape = BatchShape(buckets=((8, 4),), page_size=4, max_pages_per_seq=2, vocab_size=64,
                       history_len=8)
    b = empty_batch(shape, 8, 4, True)
    np.testing.assert_array_equal(b.sampling.knobs, np.float32([sp_mod.PAD_ROW] * 4))
    assert b.bias.ids.shape == b.bias.values.shape == (4, 0)  # no bias: width 0
    b = empty_batch(shape, 8, 4, False, bias=True)  # the biased sampler variant's shapes
    assert b.bias.ids.shape == b.bias.values.shape == (4, sp_mod.MAX_LOGIT_BIAS)
    assert (b.bias.ids == BIAS_PAD_ID).all() and not b.bias.values.any()
    assert b.prompt_logprobs.indices.shape == b.prompt_logprobs.targets.shape == (0,)
    b = empty_batch(shape, 8, 4, False, prompt_lp=True)  # the prompt logprobs pass's shapes
    assert b.prompt_logprobs.indices.shape == b.prompt_logprobs.targets.shape == (8,)
    assert b.prompt_logprobs.num.tolist() == [0]
    # Every array of every part travels with the step or late (the bitmask), exactly once.
    sent = [(name, field) for entries in multihost._wire(b).values()  # noqa: SLF001
            for name, field, _ in entries]
    late = [(name, f) for name, part in parts(b) for f in part.LATE]
    every = [(name, f) for name, part in parts(b) for f, _ in leaves(part)]
    assert sorted(sent + late) == sorted(every) and len(set(sent + late)) == len(every)


def test_sampler_reads_every_column_by_name_and_padding_is_greedy() -> None:
    import jax.numpy as jnp

    from jaxserve.device import sampler
    from jaxserve.engine.batch_mask import TokenMaskRows
    from jaxserve.engine.batch_parts import LogitBiasRows, PenaltyRows, SamplingRows

    S, V = 3, 32
    knobs = np.arange(S * len(sp_mod.DEVICE_FIELDS), dtype=np.float32).reshape(S, -1)
    st = sampler.SamplingTensors(
        SamplingRows(jnp.asarray(knobs), jnp.zeros((S, 2), jnp.uint32)),
        PenaltyRows(jnp.zeros((S, 0), jnp.int32), jnp.zeros((S, 0), bool)),
        LogitBiasRows(jnp.zeros((S, 0), jnp.int32), jnp.zeros((S, 0), jnp.float32)),
        TokenMaskRows(jnp.zeros((S, 1), jnp.int32), jnp.zeros((S,), bool)))
    for name, col in sp_mod.DEVICE_COLUMN.items():
        np.testing.assert_array_equal(np.asarray(st.knob(name)), knobs[:, col])
    logits = np.random.default_rng(0).normal(size=(S, V)).astype(np.float32)
    pad = sampler.SamplingTensors(
        SamplingRows(jnp.asarray(np.float32([sp_mod.PAD_ROW] * S)),
                     jnp.zeros((S, 2), jnp.uint32)),
        PenaltyRows(jnp.zeros((S, 0), jnp.int32), jnp.zeros((S, 0), bool)),
        LogitBiasRows(*map(jnp.asarray, pad_bias(S, True))),
        TokenMaskRows(jnp.zeros((S, 1), jnp.int32), jnp.zeros((S,), bool)))
    out = sampler.sample(jnp.asarray(logits), pad, False)
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
