"""The PEFT LoRA adapter loader (`models/lora_loader.py`, `models/peft_config.py`).

Oracle: PEFT itself. A random adapter is built on a tiny HF model (torch + peft,
`support/lora_adapters.py`), merged into the model by PEFT's `merge_and_unload`, and the merged
model read back by jaxserve's own checkpoint loader; per layer and target field the loaded
a @ b must equal W_merged - W_base in the stacked [in, out] layout (Gemma 4's padded and
repeated heads, its shared-KV and K-as-V layers included), within float32 rounding derived
from the sizes. rsLoRA, rank_pattern, alpha_pattern and layers_to_transform reach PEFT's
merge through the same adapter, so a wrong scaling or a misplaced layer is a delta of the
adapter's own size. Refusals are checked by message on adapters written by hand (numpy) and,
for options only PEFT writes, on PEFT-made ones.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest
from support.tiers import split_tiers

from jaxserve.models.hf_loader import host_params_from_hf, read_hf_config, read_hf_tensors
from jaxserve.models.host_arrays import read_all
from jaxserve.models.lora_loader import (TARGET_FIELDS, LoraAdapter, LoraError,
                                         load_peft_adapter)
from jaxserve.models.safetensors_io import write_safetensors
from jaxserve.models.tiny import tiny_config

EPS32 = float(np.finfo(np.float32).eps)


# ------------------------------------------------------------------ PEFT-made adapters
def _build(arch: str, out: pathlib.Path) -> Any:
    pytest.importorskip("peft")
    from support import hf_models

    if arch in hf_models.GEMMA_ARCHS or arch in hf_models.GEMMA4_ARCHS:
        return hf_models.build_gemma_model(arch, out)
    if arch in hf_models.MOE_ARCHS:
        return hf_models.build_moe_model(arch, out)
    return hf_models.build_hf_model(arch, out)


def _stacked_delta(tmp: pathlib.Path, hf_model: Any, base_dir: pathlib.Path,
                   adapter_dir: pathlib.Path
                   ) -> tuple[Any, dict[str, np.ndarray], dict[str, float]]:
    """(cfg, {field: W_merged - W_base, float64 [L, in, out]}, {field: max |W_merged|})
    through PEFT's merge and jaxserve's checkpoint loader."""
    from support.lora_adapters import merged_model

    merged_dir = tmp / "merged"
    merged_model(hf_model, adapter_dir).save_pretrained(merged_dir, safe_serialization=True)
    cfg = read_hf_config(base_dir)
    base = host_params_from_hf(cfg, read_hf_tensors(base_dir)).layers
    merged = host_params_from_hf(cfg, read_hf_tensors(merged_dir)).layers
    fields = [f for f in TARGET_FIELDS if getattr(base, f) is not None]
    merged_w = {f: read_all(getattr(merged, f)).astype(np.float64) for f in fields}
    return (cfg, {f: merged_w[f] - read_all(getattr(base, f)) for f in fields},
            {f: float(np.abs(merged_w[f]).max()) for f in fields})


def _check_against_merge(lora: LoraAdapter, deltas: dict[str, np.ndarray],
                         merged_abs: dict[str, float], touched: dict[str, set[int]]) -> None:
    for field, dw in deltas.items():
        layers = touched.get(field, set())
        if field not in lora.weights:
            assert not layers and not dw.any(), field
            continue
        a, b = lora.weights[field]
        assert a.dtype == b.dtype == np.float32 and not a.flags.writeable
        got = np.einsum("lir,lro->lio", a.astype(np.float64), b.astype(np.float64))
        # float32 rounding: of W_merged (half an ulp), of PEFT's B @ A * scaling and of ours
        r = a.shape[2]
        bound = np.einsum("lir,lro->lio", np.abs(a), np.abs(b)).max()
        tol = EPS32 * (merged_abs[field] + (r + 2) * bound)
        for i in range(dw.shape[0]):
            err = np.abs(got[i] - dw[i]).max()
            assert err <= tol, (field, i, err, tol)
            if i in layers:  # the adapter's effect is far above the rounding
                assert np.abs(dw[i]).max() > 1000 * tol, (field, i)
            else:
                assert not got[i].any() and not dw[i].any(), (field, i)


# arch, LoraConfig kwargs, {field: adapted layers}
def _all(n: int, fields: tuple[str, ...] = TARGET_FIELDS) -> dict[str, set[int]]:
    return {f: set(range(n)) for f in fields}


FAMILY_CASES = {
    # GQA, every target, q_proj of lower ranks (overlapping patterns: the first match wins,
    # layer 1's q 3, layer 0's q 2), o_proj an alpha of its own
    "llama_patterns": ("llama3_gqa_rope_scaling", dict(
        rank_pattern={"layers.1.self_attn.q_proj": 3, "q_proj": 2},
        alpha_pattern={"o_proj": 5}), _all(2)),
    "qwen3_rslora": ("qwen3_qknorm", dict(use_rslora=True, alpha=24), _all(2)),
    # narrower sliding layers padded to the global heads, KV shared into the last two
    # layers (no k/v there), double-wide MLPs, a subset of layers
    "gemma4_ple_layers": ("gemma4_ple", dict(layers_to_transform=[0, 1, 3, 5]), {
        **{f: {0, 1, 3, 5} for f in ("wq", "wo", "w_gate", "w_up", "w_down")},
        "wk": {0, 1, 3}, "wv": {0, 1, 3}}),
    # K = V on the global layers: their wv takes k_proj's adapter, as their base wv is wk
    "gemma4_kv": ("gemma4_kv", {}, _all(5)),
    "gemma3": ("gemma3", dict(target_modules=("q_proj", "v_proj", "down_proj")),
               _all(5, ("wq", "wv", "w_down"))),
    "mistral": ("mistral_sliding", dict(rank=2, target_modules=("k_proj", "up_proj")),
                _all(2, ("wk", "w_up"))),
    # the attention of an MoE model (its experts are refused: test_refusals_peft)
    "qwen3_moe_attention": ("qwen3_moe", dict(
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj")),
        _all(3, ("wq", "wk", "wv", "wo"))),
}


@pytest.mark.parametrize("case", split_tiers(
    list(FAMILY_CASES), list(FAMILY_CASES),
    default=["llama_patterns", "qwen3_rslora", "gemma4_ple_layers", "gemma4_kv"],
    reason="more families: the default tier has Llama, Qwen3 and both Gemma 4 layouts"))
def test_loaded_delta_equals_peft_merge(case: str, tmp_path: pathlib.Path) -> None:
    from support.lora_adapters import make_peft_adapter

    arch, kwargs, touched = FAMILY_CASES[case]
    kwargs = dict(kwargs)
    rank = kwargs.pop("rank", 4)
    alpha = kwargs.pop("alpha", 8)
    model = _build(arch, tmp_path / "base")
    adapter = make_peft_adapter(model, tmp_path / "adapter", rank=rank, alpha=alpha, seed=3,
                                **kwargs)
    cfg, deltas, merged_abs = _stacked_delta(tmp_path, model, tmp_path / "base", adapter)
    lora = load_peft_adapter(adapter, cfg, max_rank=rank)
    _check_against_merge(lora, deltas, merged_abs, touched)
    assert lora.target_fields == tuple(f for f in TARGET_FIELDS if touched.get(f))
    assert lora.rank == rank and lora.path == str(adapter)
    assert lora.nbytes == sum(a.nbytes + b.nbytes for a, b in lora.weights.values())
    if case == "llama_patterns":  # a lower-rank layer is zero-padded to the field's rank
        a, b = lora.weights["wq"]
        assert a.shape[2] == b.shape[1] == 3
        assert a[1].all() and b[1].all() and a[0, :, :2].all() and b[0, :2].all()
        assert not a[0, :, 2:].any() and not b[0, 2:].any()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, pathlib.Path]:
    d = tmp_path_factory.mktemp("llama") / "base"
    return _build("llama2_mha", d), d


PEFT_REFUSALS = {
    "dora": (dict(use_dora=True), ["use_dora=True", "DoRA"]),
    "bias": (dict(bias="all"), ["bias='all'"]),
    "modules_to_save": (dict(modules_to_save=["lm_head"]), ["modules_to_save", "lm_head"]),
    "rank_over_max": (dict(rank=16), ["module 'model.layers.0.", "rank 16",
                                      "maximum LoRA rank 8"]),
    "pattern_rank_over_max": (dict(rank_pattern={"layers.1.mlp.down_proj": 12}),
                              ["model.layers.1.mlp.down_proj", "rank 12", "rank 8"]),
    "embed_tokens": (dict(target_modules=["q_proj", "embed_tokens"]),
                     ["target_modules ['embed_tokens']", "not adaptable"]),
    "lm_head": (dict(target_modules=["lm_head", "v_proj"]), ["['lm_head']", "not adaptable"]),
}


@pytest.mark.parametrize("case", list(PEFT_REFUSALS))
def test_refusals_peft(case: str, tiny_llama: tuple[Any, pathlib.Path],
                       tmp_path: pathlib.Path) -> None:
    from support.lora_adapters import make_peft_adapter

    model, base_dir = tiny_llama
    kwargs, words = PEFT_REFUSALS[case]
    kwargs = dict(kwargs)
    adapter = make_peft_adapter(model, tmp_path / "a", rank=kwargs.pop("rank", 4), **kwargs)
    with pytest.raises(LoraError) as e:
        load_peft_adapter(adapter, read_hf_config(base_dir), max_rank=8)
    _assert_message(str(e.value), adapter, words)


@pytest.mark.parametrize("case", split_tiers(
    ["moe_experts"], ["moe_experts"], default=[],
    reason="another HF model build for one refusal"))
def test_refusals_peft_moe(case: str, tmp_path: pathlib.Path) -> None:
    from support.lora_adapters import make_peft_adapter

    model = _build("qwen3_moe", tmp_path / "base")
    # PEFT turns the experts' gate/up/down into parameter targets on their fused stacks
    adapter = make_peft_adapter(model, tmp_path / "a", rank=4,
                                target_modules=("q_proj", "gate_proj", "up_proj", "down_proj"))
    with pytest.raises(LoraError) as e:
        load_peft_adapter(adapter, read_hf_config(tmp_path / "base"), max_rank=8)
    _assert_message(str(e.value), adapter, ["target_parameters", "MoE expert"])


def _assert_message(msg: str, adapter: pathlib.Path, words: list[str]) -> None:
    assert str(adapter) in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    assert len(msg) < 500 + len(str(adapter)), msg


# --------------------------------------------------------------- hand-written adapters
CFG = tiny_config()  # 2 layers, hidden 64, q 64, kv 32, intermediate 128
PREFIX = "base_model.model.model.layers"


def _tensors(rank: int = 4, seed: int = 0, modules: tuple[str, ...] = (
        "self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")) -> dict[str, np.ndarray]:
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.v_proj": (32, 64),
              "mlp.down_proj": (64, 128)}  # [out, in]
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(CFG.num_layers):
        for m in modules:
            n_out, n_in = shapes[m]
            out[f"{PREFIX}.{i}.{m}.lora_A.weight"] = rng.standard_normal((rank, n_in), np.float32)
            out[f"{PREFIX}.{i}.{m}.lora_B.weight"] = rng.standard_normal((n_out, rank),
                                                                         np.float32)
    return out


def _config(**changes: object) -> dict[str, object]:
    d: dict[str, object] = {
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": [
            "q_proj", "v_proj", "down_proj"], "bias": "none", "use_rslora": False,
        "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
        "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
        "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "inference_mode": True}
    return d | changes


def _write(d: pathlib.Path, config: dict[str, object] | None = None,
           tensors: dict[str, np.ndarray] | None = None) -> pathlib.Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps(_config() if config is None else config))
    write_safetensors(d / "adapter_model.safetensors", _tensors() if tensors is None else tensors,
                      {"format": "pt"})
    return d


def test_hand_written_adapter_layout(tmp_path: pathlib.Path) -> None:
    """A @ B placement, scaling, and the ".default." name infix of some PEFT versions."""
    t = _tensors()
    lora = load_peft_adapter(_write(tmp_path / "plain", tensors=t), CFG, max_rank=4)
    infixed = {k.replace(".weight", ".default.weight"): v for k, v in t.items()}
    again = load_peft_adapter(_write(tmp_path / "infix", tensors=infixed), CFG, max_rank=4)
    assert lora.target_fields == again.target_fields == ("wq", "wv", "w_down")
    for field, module in (("wq", "self_attn.q_proj"), ("wv", "self_attn.v_proj"),
                          ("w_down", "mlp.down_proj")):
        a, b = lora.weights[field]
        for i in range(2):
            np.testing.assert_array_equal(a[i], t[f"{PREFIX}.{i}.{module}.lora_A.weight"].T)
            np.testing.assert_array_equal(b[i], t[f"{PREFIX}.{i}.{module}.lora_B.weight"].T * 2)
        np.testing.assert_array_equal(again.weights[field][0], a)
        np.testing.assert_array_equal(again.weights[field][1], b)


def test_half_precision_loads_as_float32(tmp_path: pathlib.Path) -> None:
    t = _tensors()
    half = {k: v.astype(ml_dtypes.bfloat16 if "lora_A" in k else np.float16)
            for k, v in t.items()}
    lora = load_peft_adapter(_write(tmp_path / "a", tensors=half), CFG, max_rank=4)
    a, b = lora.weights["wq"]
    assert a.dtype == b.dtype == np.float32
    np.testing.assert_array_equal(a[0], half[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"]
                                  .astype(np.float32).T)
    np.testing.assert_array_equal(b[0], half[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"]
                                  .astype(np.float32).T * 2)


def _renamed(old: str, new: str) -> Callable[[dict], dict]:
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


def _plus(name: str, value: np.ndarray) -> Callable[[dict], dict]:
    return lambda t: t | {name: value}


_A0 = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
# case -> (config changes, tensor change, words the message must hold); max_rank 8
HAND_REFUSALS: dict[str, tuple[dict, Callable[[dict], dict] | None, list[str]]] = {
    "peft_type": (dict(peft_type="IA3"), None, ["peft_type='IA3'", "LoRA"]),
    "fan_in_fan_out": (dict(fan_in_fan_out=True), None, ["fan_in_fan_out=True"]),
    "lora_bias": (dict(lora_bias=True), None, ["lora_bias=True"]),
    "layer_replication": (dict(layer_replication=[[0, 2]]), None, ["layer_replication"]),
    "alora": (dict(alora_invocation_tokens=[5, 6]), None, ["alora_invocation_tokens"]),
    "target_parameters": (dict(target_parameters=["experts.gate_up_proj"]), None,
                          ["target_parameters"]),
    "unknown_option": (dict(new_peft_trick={"on": 1}), None, ["new_peft_trick", "does not know"]),
    "bad_r": (dict(r="8"), None, ["r='8'", "positive integer"]),
    "bad_alpha": (dict(lora_alpha=None), None, ["lora_alpha=None", "finite number"]),
    "bad_regex": (dict(rank_pattern={"q_proj(": 2}), None, ["rank_pattern", "regular expr"]),
    "target_unknown": (dict(target_modules=["q_proj", "w1", "lm_head"]), None,
                       ["['lm_head', 'w1']", "not adaptable", "q_proj"]),
    "rank_over_max": (dict(r=16), lambda t: _tensors(rank=16),
                      ["module 'model.layers.0.", "has rank 16", "rank 8"]),
    "rank_mismatch": (dict(r=2), None, [_A0, "shape [4, 64]", "expected [2, 64]"]),
    "shape_mismatch": ({}, _plus(_A0, np.zeros((4, 48), np.float32)),
                       [_A0, "shape [4, 48]", "expected [4, 64]", "does not fit"]),
    "layer_out_of_range": ({}, _renamed("layers.1.", "layers.7."),
                           ["layer 7", "has 2 layers"]),
    "outside_layers_to_transform": (dict(layers_to_transform=[0]), None,
                                    ["layer 1", "layers_to_transform=[0]"]),
    "unknown_tensor": ({}, _plus("base_model.model.score.weight", np.zeros((2, 64), np.float32)),
                       ["base_model.model.score.weight", "not a LoRA weight"]),
    "lm_head_tensor": ({}, _plus("base_model.model.lm_head.lora_A.weight",
                                 np.zeros((4, 64), np.float32)), ["lm_head", "not served"]),
    "embedding_tensor": ({}, _plus("base_model.model.model.embed_tokens.lora_embedding_A",
                                   np.zeros((4, 1024), np.float32)), ["embedding adapters"]),
    "dora_tensor": ({}, _plus(f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector",
                              np.ones(64, np.float32)), ["DoRA"]),
    "expert_module": (dict(target_modules=".*proj"), lambda t: t | {
        f"{PREFIX}.0.mlp.experts.3.gate_proj.lora_A.weight": np.zeros((4, 64), np.float32),
        f"{PREFIX}.0.mlp.experts.3.gate_proj.lora_B.weight": np.zeros((128, 4), np.float32)},
        ["mlp.experts.3.gate_proj", "MoE experts"]),
    "module_model_lacks": (dict(target_modules=".*proj"), lambda t: t | {
        f"{PREFIX}.1.self_attn.x_proj.lora_A.weight": np.zeros((4, 64), np.float32),
        f"{PREFIX}.1.self_attn.x_proj.lora_B.weight": np.zeros((64, 4), np.float32)},
        ["model.layers.1.self_attn.x_proj", "no adaptable self_attn.x_proj in layer 1"]),
    "missing_partner": ({}, lambda t: {k: v for k, v in t.items()
                                       if k != f"{PREFIX}.1.mlp.down_proj.lora_B.weight"},
                        ["layers.1.mlp.down_proj.lora_A.weight", "no lora_B partner"]),
    "int_dtype": ({}, _plus(_A0, np.zeros((4, 64), np.int32)), [_A0, "dtype int32"]),
    "non_finite": ({}, _plus(_A0, np.full((4, 64), np.nan, np.float32)), [_A0, "non-finite"]),
    "no_tensors": ({}, lambda t: {}, ["holds no tensors"]),
}


@pytest.mark.parametrize("case", list(HAND_REFUSALS))
def test_refusals(case: str, tmp_path: pathlib.Path) -> None:
    changes, change_tensors, words = HAND_REFUSALS[case]
    tensors = _tensors() if change_tensors is None else change_tensors(_tensors())
    d = _write(tmp_path / "a", _config(**changes), tensors)
    with pytest.raises(LoraError) as e:
        load_peft_adapter(d, CFG, max_rank=8)
    _assert_message(str(e.value), d, words)


def _only_bin(d: pathlib.Path) -> None:
    _write(d)
    (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")


FILE_REFUSALS: dict[str, tuple[Callable[[pathlib.Path], None], list[str]]] = {
    "no_dir": (lambda d: None, ["no such adapter directory"]),
    "no_config": (lambda d: (_write(d), (d / "adapter_config.json").unlink()),
                  ["no adapter_config.json"]),
    "no_weights": (lambda d: (_write(d), (d / "adapter_model.safetensors").unlink()),
                   ["no adapter_model.safetensors"]),
    "only_bin": (_only_bin, ["adapter_model.bin", "never unpickles"]),
    "bad_json": (lambda d: (_write(d), (d / "adapter_config.json").write_text("{r: 8")),
                 ["adapter_config.json is not valid JSON"]),
    "json_list": (lambda d: (_write(d), (d / "adapter_config.json").write_text("[1]")),
                  ["JSON object"]),
    "truncated": (lambda d: (_write(d), (d / "adapter_model.safetensors").write_bytes(
        (d / "adapter_model.safetensors").read_bytes()[:300])), ["adapter_model.safetensors"]),
}


@pytest.mark.parametrize("case", list(FILE_REFUSALS))
def test_file_refusals(case: str, tmp_path: pathlib.Path) -> None:
    make, words = FILE_REFUSALS[case]
    d = tmp_path / "adapter"
    make(d)
    with pytest.raises(LoraError) as e:
        load_peft_adapter(d, CFG, max_rank=8)
    _assert_message(str(e.value), d, words)


def test_unset_options_accepted(tmp_path: pathlib.Path) -> None:
    """Options PEFT writes switched off (null, false, 0, empty), known or not, are no reason
    to refuse; the same option switched on is (test_refusals: unknown_option)."""
    config = _config(bias=None, use_dora=False, new_peft_trick=None, other_new_option=0,
                     third={}, megatron_config=None, init_lora_weights="gaussian")
    lora = load_peft_adapter(_write(tmp_path / "a", config), CFG, max_rank=4)
    assert lora.target_fields == ("wq", "wv", "w_down")


def test_safetensors_only_no_pickle_read(tmp_path: pathlib.Path) -> None:
    """A .bin beside the safetensors file is never opened (only the safetensors counts)."""
    d = _write(tmp_path / "a")
    (d / "adapter_model.bin").write_bytes(b"\x80\x04 not a pickle anyone reads")
    lora = load_peft_adapter(d, CFG, max_rank=4)
    assert lora.target_fields == ("wq", "wv", "w_down")
