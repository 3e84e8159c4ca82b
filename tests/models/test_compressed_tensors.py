"""compressed-tensors checkpoints (FP8 / INT8, channel or tensor scales) load as they are stored.

Oracles: the q and scale `tests/support/compressed_ckpt.py` wrote (quantized there with numpy, pack-
quantized int32s built arithmetically), and the float checkpoint of the dequantized weights
(q * scale in f32) loaded by the float path, whose logits the quantized model must give within
f32 rounding (the quantized matmul scales after the dot). Malformed configs and tensors are a
CheckpointError naming the config key or the tensor.
"""

from __future__ import annotations

import copy
import json
import logging
import pathlib

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.compressed_ckpt import (pack_int8, quantization_config, quantize,  # noqa: E402
                             write_compressed)
from support.engine_fixtures import run_device_worker  # noqa: E402
from support.hf_models import build_hf_model, save_tiny_tokenizer  # noqa: E402
from support.numerics import logits_atol  # noqa: E402

from jaxserve.models import compressed_tensors, decoder, loading, quantized_params  # noqa: E402
from jaxserve.models.hf_loader import read_hf_tensors, with_quantized_views  # noqa: E402
from jaxserve.models.quant import QuantizedWeight, WeightQuant, quantize_weight  # noqa: E402
from jaxserve.models.safetensors_io import (CheckpointError, read_safetensors,  # noqa: E402
                                            write_safetensors)

# The module's fixture runs a subprocess worker with its own 900 s limit; its first test
# (which builds the fixture) may take that long, and the limit lies past it so that the
# worker's TimeoutExpired, with its stderr, is what reports a hang.
pytestmark = pytest.mark.timeout(960)

TOKENS = np.array([[5, 17, 99, 3, 42, 8, 150, 7]], np.int32)
HF_NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
            "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
            "w_down": "mlp.down_proj"}
# (scheme, strategy, pack-quantized, activations the checkpoint was made for, ignore)
VARIANTS = {
    "fp8_dynamic": ("fp8", "channel", False, "fp8", ("lm_head",)),
    "fp8_tensor": ("fp8", "tensor", False, None, ()),
    "int8_w8a8": ("int8", "channel", False, "int8", ("lm_head",)),
    "int8_tensor": ("int8", "tensor", False, None, ()),
    "w8a16_packed": ("int8", "channel", True, None, ("lm_head",)),
}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("ct") / "llama"  # untied: the lm_head can be quantized too
    build_hf_model("llama2_mha", d)
    save_tiny_tokenizer(d, 211)
    return d


def _variant(src: pathlib.Path, name: str) -> pathlib.Path:
    """The compressed dir of VARIANTS[name] (written once per module)."""
    dst = src.parent / name
    if not dst.exists():
        write_compressed(src, dst, *VARIANTS[name])
    return dst


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def ckpt(request, src) -> tuple[str, pathlib.Path, pathlib.Path]:
    """(variant, compressed dir, float dir of its dequantized weights)."""
    dst = _variant(src, request.param)
    return request.param, dst, pathlib.Path(f"{dst}-float")


def _views(d: pathlib.Path) -> dict:
    return with_quantized_views(d, read_hf_tensors(d))


def _logits(model: loading.LoadedModel) -> np.ndarray:
    return np.asarray(decoder.forward_jit(model.params, TOKENS, np.array([TOKENS.shape[1]],
                                                                         np.int32),
                                          cfg=model.config))


def _bits(a: object) -> np.ndarray:
    """An int8 / fp8 array's bytes (how stored.npz keeps them)."""
    return np.asarray(a).view(np.uint8)


def test_values_and_scales_are_the_files(ckpt) -> None:
    variant, dst, _ = ckpt
    scheme, strategy, _, _, ignore = VARIANTS[variant]
    stored = np.load(dst / "stored.npz")
    model = loading.load_model(dst)
    for field, module in HF_NAMES.items():
        w = getattr(model.params.layers, field)
        assert isinstance(w, QuantizedWeight) and w.scheme == scheme and w.zeros is None, field
        assert w.scales.shape[-2] == 1  # one scale per output column
        for i in range(model.config.num_layers):
            q = stored[f"model.layers.{i}.{module}.q"]
            scale = stored[f"model.layers.{i}.{module}.scale"].reshape(-1)
            np.testing.assert_array_equal(_bits(w.values[i]), q.T, err_msg=field)
            np.testing.assert_array_equal(np.asarray(w.scales[i, 0]),
                                          np.broadcast_to(scale, (q.shape[0],)), err_msg=field)
    head = model.params.lm_head
    assert isinstance(head, QuantizedWeight) is ("lm_head" not in ignore)
    assert not isinstance(model.params.embed, QuantizedWeight)  # embeddings are never targeted


def test_logits_are_the_dequantized_float_models(ckpt) -> None:
    _, dst, ref = ckpt
    want = _logits(loading.load_model(ref))
    got = _logits(loading.load_model(dst))
    # The same values multiplied in another order (x @ (q * s) against (x @ q) * s, or packed
    # panels): the float32 reordering bound of the dequantized model, from its weights (the
    # extra rounding of q * s per term turns a stage's gamma_n into gamma_(n+1): 1/n more).
    float_model = loading.load_model(ref)
    assert np.max(np.abs(got - want)) <= logits_atol(float_model.config, float_model.params,
                                                     TOKENS.shape[1])
    # "none" dequantizes on the float path: q * scale in f32, as the oracle's weights.
    none = loading.load_model(dst, quant=WeightQuant("none"))
    assert not isinstance(none.params.layers.wq, QuantizedWeight)
    np.testing.assert_array_equal(_logits(none), want)


def test_convert_writes_the_dequantized_floats(src, tmp_path) -> None:
    """`jaxserve convert` of a compressed checkpoint: a float HF directory of q * scale."""
    dst = _variant(src, "w8a16_packed")
    out = loading.convert(dst, tmp_path / "out", fmt="hf")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    np.testing.assert_array_equal(_logits(loading.load_model(out)),
                                  _logits(loading.load_model(f"{dst}-float")))


def test_an_other_scheme_requantizes_the_dequantized_weights(ckpt, caplog) -> None:
    variant, dst, ref = ckpt
    other = "int4" if VARIANTS[variant][0] == "fp8" else "fp8"
    with caplog.at_level(logging.INFO, logger=quantized_params.__name__):
        model = loading.load_model(dst, quant=WeightQuant(other))
    assert "dequantized and quantized to " + other in caplog.text
    floats = read_safetensors(ref / "model.safetensors")
    w = model.params.layers.w_up
    assert w.scheme == other
    for i in range(model.config.num_layers):
        expect = quantize_weight(floats[f"model.layers.{i}.mlp.up_proj.weight"].T, other)
        np.testing.assert_array_equal(_bits(w.values[i]), _bits(expect.values))
        np.testing.assert_array_equal(np.asarray(w.scales[i]), expect.scales)
    # The same scheme at another group size is requantized too; at its own, taken as stored.
    same = VARIANTS[variant][0]
    assert loading.load_model(dst, quant=WeightQuant(same, 32)).params.layers.wq.group_size == 32
    exact = loading.load_model(dst, quant=WeightQuant(same)).params.layers.wq
    np.testing.assert_array_equal(_bits(exact.values),
                                  _bits(loading.load_model(dst).params.layers.wq.values))


def test_layers_the_ignore_list_names_are_quantized_to_the_stored_scheme(src, tmp_path,
                                                                        caplog) -> None:
    """One layer's down_proj left float: the field keeps layer 0 as stored and quantizes
    layer 1 per column to fp8 (one stack holds one scheme)."""
    dst = tmp_path / "partly"
    ref = write_compressed(src, dst, "fp8", "channel", ignore=("lm_head",
                                                                "model.layers.1.mlp.down_proj"))
    with caplog.at_level(logging.INFO, logger=quantized_params.__name__):
        w = loading.load_model(dst).params.layers.w_down
    assert "layers.w_down: 1 of 2 layers stored as compressed-tensors fp8" in caplog.text
    assert w.scheme == "fp8" and w.group_size == 96
    stored = np.load(dst / "stored.npz")
    np.testing.assert_array_equal(_bits(w.values[0]), stored["model.layers.0.mlp.down_proj.q"].T)
    np.testing.assert_array_equal(np.asarray(w.scales[0, 0]),
                                  stored["model.layers.0.mlp.down_proj.scale"][:, 0])
    layer1 = read_safetensors(ref / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    expect = quantize_weight(np.asarray(layer1).T, "fp8")
    np.testing.assert_array_equal(_bits(w.values[1]), _bits(expect.values))
    np.testing.assert_array_equal(np.asarray(w.scales[1]), expect.scales)


@pytest.mark.parametrize("fp8_matmuls", [False, True])
def test_auto_keeps_dynamic_fp8_activations_only_with_fp8_matmuls(src, fp8_matmuls,
                                                                   caplog) -> None:
    dst = _variant(src, "fp8_dynamic")
    host = loading.host_params_from_hf(loading.read_hf_config(dst), _views(dst))
    with caplog.at_level(logging.INFO, logger=quantized_params.__name__):
        params = quantized_params.quantize_params(host, WeightQuant(fp8_matmuls=fp8_matmuls))
    assert all(getattr(params.layers, f).act_fp8 is fp8_matmuls for f in HF_NAMES)
    assert ("W8A8" in caplog.text) and (("no fp8 matmuls" in caplog.text) is not fp8_matmuls)
    # A weight-only checkpoint stays weight-only on any platform.
    plain = _variant(src, "fp8_tensor")
    host = loading.host_params_from_hf(loading.read_hf_config(plain), _views(plain))
    params = quantized_params.quantize_params(host, WeightQuant(fp8_matmuls=True))
    assert not params.layers.wq.act_fp8


def test_views_read_only_their_box(src) -> None:
    """The lazy views behind placement: any box equals the same box of the whole."""
    dst = _variant(src, "w8a16_packed")
    stored = np.load(dst / "stored.npz")
    t = _views(dst)["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(t, compressed_tensors.CompressedTensor) and t.shape == (64, 96)
    q = stored["model.layers.1.mlp.down_proj.q"].view(np.int8)
    whole = q.astype(np.float32) * stored["model.layers.1.mlp.down_proj.scale"]
    np.testing.assert_array_equal(t[...], whole)
    for box in [(slice(3, 40), slice(5, 67)), (slice(0, 1), slice(95, 96)), (slice(32, 64),)]:
        np.testing.assert_array_equal(t.values[box], q[box])
        np.testing.assert_array_equal(t[box], whole[box])


def test_a_pack_quantized_row_that_four_does_not_divide() -> None:
    """in = 6: the last int32 of each row holds two values and two padding bytes."""
    q = np.array([[-128, -1, 0, 1, 127, 5], [3, 2, 1, 0, -1, -2]], np.int8)
    view = compressed_tensors.PackedInt8(pack_int8(q), 6)
    np.testing.assert_array_equal(view[...], q)
    np.testing.assert_array_equal(view[1:2, 3:6], q[1:2, 3:6])


@pytest.fixture(scope="module")
def tp_rows() -> dict:
    return {r["variant"]: r for r in run_device_worker("compressed_tp_worker.py")["rows"]}


@pytest.mark.slow(reason="an 8-device subprocess loading compressed-tensors checkpoints at "
                  "TP 2: the single-device loads are tested in the default tier")
@pytest.mark.parametrize("variant", ["fp8_dynamic", "w8a16_packed_tensor"])
def test_tensor_parallel_load_gives_the_single_device_logits(tp_rows, variant) -> None:
    """TP 2 straight from the file (8 heads, 2 KV heads): the TP 1 params placed on the mesh,
    leaf for leaf; each device read only its slice of the stored values; the TP 1 logits
    within f32 rounding (the row-split layers' partial sums are added in another order); and
    the same greedy tokens from a TP 2 engine."""
    r = tp_rows[variant]
    assert r["quantized"] and r["same_tree"] and r["mismatched"] == []
    assert r["values_shape"] == [2, 64, 64] and r["values_shard"] == [2, 64, 32]
    assert r["value_reads"] == 7 * 2 * 2 and r["bad_reads"] == []  # linears x layers x devices
    assert r["logits_err"] <= r["logits_atol"]  # support.numerics.logits_atol, in the worker
    assert len(r["tokens_tp1"]) == 8 and r["tokens_tp2"] == r["tokens_tp1"]


# ------------------------------------------------------------------------------ malformed
def _bad_config(src: pathlib.Path, tmp: pathlib.Path, edit) -> pathlib.Path:
    dst = tmp / "bad"
    write_compressed(src, dst, "fp8", "channel", acts="fp8")
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg["quantization_config"]
    edit(qc, qc["config_groups"]["group_0"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _set(path: str, value: object):
    def edit(qc: dict, group: dict) -> None:
        where, *keys = path.split(".")
        d = qc if where == "qc" else group
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return edit


def _two_groups(qc: dict, group: dict) -> None:
    other = copy.deepcopy(group)
    other["weights"]["strategy"] = "tensor"
    qc["config_groups"]["group_1"] = other


BAD_CONFIGS = {
    "group strategy": (_set("g.weights.strategy", "group"),
                       "config_groups.group_0.weights.strategy='group'"),
    "block strategy": (_set("g.weights.strategy", "block"), "weights.strategy='block'"),
    "asymmetric": (_set("g.weights.symmetric", False), "weights.symmetric=False"),
    "4-bit pack-quantized": (_set("g.weights.num_bits", 4), "weights.num_bits=4"),
    "static activations": (_set("g.input_activations.dynamic", False),
                           "input_activations.dynamic=False"),
    "other method": (_set("qc.quant_method", "gptq"), "quant_method='gptq'"),
    "other format": (lambda qc, g: (qc.update(format="marlin-24"), g.pop("format")),
                     "format='marlin-24'"),
    "float format, int weights": (_set("g.weights.type", "int"), "format='float-quantized'"),
    "kv cache scheme": (_set("qc.kv_cache_scheme", {"num_bits": 8}), "kv_cache_scheme="),
    "preset name": (_set("qc.config_groups", {"FP8_DYNAMIC": ["Linear"]}),
                    "config_groups.FP8_DYNAMIC=['Linear']"),
    "two schemes": (_two_groups, "config_groups=['group_0', 'group_1']"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_unsupported_configs_name_the_key(src, tmp_path, case) -> None:
    edit, key = BAD_CONFIGS[case]
    dst = _bad_config(src, tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        loading.load_model(dst)
    assert str(dst / "config.json") in str(e.value) and key in str(e.value), str(e.value)


def _edit_tensors(src: pathlib.Path, tmp: pathlib.Path, scheme: str, strategy: str,
                  edit) -> pathlib.Path:
    dst = tmp / "bad"
    write_compressed(src, dst, scheme, strategy)
    tensors = {k: np.array(v) for k, v in read_safetensors(dst / "model.safetensors").items()}
    edit(tensors)
    write_safetensors(dst / "model.safetensors", tensors)
    return dst


NAME = "model.layers.0.self_attn.q_proj"
BAD_TENSORS = {
    "scale of the wrong shape": ("fp8", "channel",
                                 lambda t: t.update({NAME + ".weight_scale": np.ones((2, 64),
                                                                                     np.float32)}),
                                 NAME + ".weight_scale"),
    "int8 values under an fp8 config": (
        "fp8", "tensor", lambda t: t.update({NAME + ".weight": np.zeros((64, 64), np.int8)}),
        NAME + ".weight"),
    "a static input scale": ("fp8", "tensor",
                             lambda t: t.update({NAME + ".input_scale": np.ones(1, np.float32)}),
                             NAME + ".input_scale"),
    "a scale without values": ("int8", "channel", lambda t: t.pop(NAME + ".weight"),
                               NAME + ".weight"),
    "an integer scale": ("int8", "tensor",
                         lambda t: t.update({NAME + ".weight_scale": np.ones(1, np.int32)}),
                         NAME + ".weight_scale"),
}


@pytest.mark.parametrize("case", sorted(BAD_TENSORS))
def test_malformed_tensors_name_the_tensor(src, tmp_path, case) -> None:
    scheme, strategy, edit, name = BAD_TENSORS[case]
    dst = _edit_tensors(src, tmp_path, scheme, strategy, edit)
    with pytest.raises(CheckpointError) as e:
        loading.load_model(dst)
    assert name in str(e.value), str(e.value)


def test_quantize_helper_is_what_the_format_stores() -> None:
    """The oracle's quantizer: per-row amax / 448 (fp8) or / 127 (int8) scales."""
    w = np.array([[1.0, -2.0, 0.5, 4.0], [0.25, 0.0, -0.125, 0.0625]], np.float32)
    q, s = quantize(w, "int8", "channel")
    np.testing.assert_array_equal(s[:, 0], np.float32([4 / 127, 0.25 / 127]))
    assert q[0, 3] == 127 and q[1, 0] == 127 and q[0, 0] == -128  # forced: the format's min
    q, s = quantize(w, "fp8", "tensor")
    assert s.shape == (1,) and float(np.abs(q.astype(np.float32)).max()) == 448.0
    assert quantization_config("fp8", "channel", acts="fp8")["format"] == "float-quantized"
