"""The family registry and the Llama family's HF config -> per-layer spec mapping.

Oracles: the specs each Llama-family variant's HF config (built by transformers' own config
classes, as the parity tests' checkpoints are) must give, written out by hand; the registry's
answers for known and unknown names.
"""

from __future__ import annotations

import dataclasses

import pytest
from support.hf_models import ARCHS

from jaxserve.models import families, llama, mixtral
from jaxserve.models.config import ConfigError, LayerGroup, LayerSpec, RopeScaling
from jaxserve.models.safetensors_io import CheckpointError
from jaxserve.models.tiny import tiny_config


def hf_dict(arch: str, **extra: object) -> dict:
    import transformers

    cls_name, kwargs = ARCHS[arch]
    return getattr(transformers, cls_name)(**(kwargs | extra)).to_dict()


# SmolLM2-135M's config.json (the bundled model): a LlamaForCausalLM with tied embeddings.
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
           "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
           "rope_theta": 100000, "max_position_embeddings": 8192, "tie_word_embeddings": True,
           "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}

EXPECTED = {
    "llama2_mha": LayerSpec(rope_theta=10000.0, query_scale=16 ** -0.5),
    "llama3_gqa_rope_scaling": LayerSpec(
        rope_theta=500000.0, query_scale=8 ** -0.5,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32)),
    "llama_tied_headdim": LayerSpec(rope_theta=10000.0, query_scale=24 ** -0.5),
    "llama_linear_rope": LayerSpec(rope_theta=10000.0, query_scale=16 ** -0.5,
                                   rope_scaling=RopeScaling("linear", 2.0)),
    "mistral_sliding": LayerSpec(sliding_window=5, rope_theta=10000.0, query_scale=16 ** -0.5),
    "qwen2_bias": LayerSpec(rope_theta=1e6, query_scale=16 ** -0.5, attention_bias=True),
    "qwen3_qknorm": LayerSpec(rope_theta=1e6, query_scale=32 ** -0.5, qk_norm=True),
}


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_llama_family_specs_from_hf(arch: str) -> None:
    cfg = families.config_from_hf(hf_dict(arch))
    assert families.family(cfg) is llama
    assert cfg.layer_specs == (EXPECTED[arch],) * cfg.num_layers
    # Every Llama-family layer is alike: one group, one scan, as before the blocks.
    assert cfg.layer_groups == (LayerGroup(EXPECTED[arch], 0, cfg.num_layers),)
    assert EXPECTED[arch].attention_type == (
        "sliding_attention" if arch == "mistral_sliding" else "full_attention")


def test_smollm_spec_and_round_trip() -> None:
    cfg = families.config_from_hf(SMOLLM2)
    assert cfg.tie_word_embeddings and cfg.head_dim == 64
    assert set(cfg.layer_specs) == {LayerSpec(rope_theta=100000.0, query_scale=0.125)}
    assert families.config_from_hf(families.config_to_hf(cfg)) == cfg


def test_mixed_specs_have_no_llama_config_json() -> None:
    cfg = tiny_config()
    local = dataclasses.replace(cfg.uniform_spec(), sliding_window=4)
    mixed = dataclasses.replace(cfg, per_layer=(local, cfg.uniform_spec()))
    with pytest.raises(ConfigError, match="per-layer specs .* no HF config.json form"):
        families.config_to_hf(mixed)
    same = dataclasses.replace(cfg, per_layer=(cfg.uniform_spec(),) * 2)
    assert families.config_to_hf(same) == families.config_to_hf(cfg)


def test_qwen_window_only_when_asked() -> None:
    """Qwen2/3 configs carry a `sliding_window` that applies only with use_sliding_window."""
    off = families.config_from_hf(hf_dict("qwen2_bias", sliding_window=7))
    on = families.config_from_hf(hf_dict("qwen2_bias", sliding_window=7,
                                         use_sliding_window=True, max_window_layers=0))
    assert {s.sliding_window for s in off.layer_specs} == {None}
    assert {s.sliding_window for s in on.layer_specs} == {7}


def test_architectures_alone_name_the_family() -> None:
    d = dict(SMOLLM2)
    d.pop("model_type")
    d["architectures"] = ["Qwen3ForCausalLM"]
    assert families.config_from_hf(d).model_type == "qwen3"


@pytest.mark.parametrize("d", [
    {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]},
    {"architectures": ["GPTNeoXForCausalLM"]},
    {"architectures": 3},
])
def test_unknown_hf_architecture(d: dict) -> None:
    shape = {k: v for k, v in SMOLLM2.items() if k not in ("model_type", "architectures")}
    with pytest.raises(ConfigError, match=r"config.json: model_type=.*is not supported; "
                                          r"supported: llama, mistral, qwen2, qwen3"):
        families.config_from_hf(shape | d)


def test_unknown_model_type_and_gguf_architecture() -> None:
    with pytest.raises(ConfigError, match="model_type='gpt_neox' is not supported"):
        families.family("gpt_neox")
    with pytest.raises(ConfigError, match=r"f.gguf: GGUF metadata 'general.architecture'="
                                          r"'falcon' is not supported; supported: llama"):
        families.family_for_gguf("falcon", "f.gguf")
    assert families.family_for_gguf("qwen2", "f.gguf") == (llama, "qwen2")
    with pytest.raises(TypeError, match="params pytree of no registered family"):
        families.family_of_params({"embed": None})


def test_gguf_unknown_architecture_is_a_checkpoint_error(tmp_path: object) -> None:
    """The GGUF loader keeps its one error type for a file's contents."""
    from jaxserve.models.gguf_loader import _hf_config

    with pytest.raises(CheckpointError, match="'general.architecture'='falcon' is not supported"):
        _hf_config({"general.architecture": "falcon"}, set(), "f.gguf")


@pytest.mark.parametrize("fam", families.FAMILIES, ids=lambda f: f.__name__.rsplit(".", 1)[-1])
def test_family_tables_cover_the_params(fam) -> None:  # noqa: ANN001 - a family module
    """Every params field has an HF name, a TP layout; every GGUF name maps to an HF one (the
    Llama family names every field in GGUF too; Gemma has no GGUF names for q/k/v biases; a
    family served from no GGUF architecture, Gemma 4, has no GGUF names)."""
    layer_fields = set(fam.LayerParams.__dataclass_fields__)
    assert set(fam.HF_LAYER_NAMES) == layer_fields == set(fam.TP_LAYOUT)
    assert set(fam.HF_NAMES) == set(fam.Params.__dataclass_fields__) - {"layers"}
    hf_layer = {name for name, _ in fam.HF_LAYER_NAMES.values()}
    assert set(fam.GGUF_LAYER_NAMES.values()) <= hf_layer
    if fam is llama:
        assert set(fam.GGUF_LAYER_NAMES.values()) == hf_layer
    if fam.GGUF_ARCHITECTURES or fam is mixtral:  # Mixtral: files of architecture `llama`
        assert set(fam.GGUF_NAMES.values()) == {name for name, _ in fam.HF_NAMES.values()}
    else:
        assert not fam.GGUF_NAMES and not fam.GGUF_LAYER_NAMES
    # MoE families: the merged expert tensors name each expert's HF tensor
    if hasattr(fam, "GGUF_EXPERT_NAMES"):
        assert set(fam.GGUF_EXPERT_NAMES.values()) == set(fam.EXPERT_NAMES.values())
    assert set(fam.LINEAR_FIELDS) | set(fam.KV_FIELDS) <= layer_fields


def test_per_layer_specs_group_in_layer_order() -> None:
    """Gemma 3's pattern, five sliding-window layers per global one, is data: groups."""
    local = LayerSpec(sliding_window=512, rope_theta=10000.0)
    glob = LayerSpec(rope_theta=1e6, rope_scaling=RopeScaling("linear", 8.0))
    cfg = tiny_config(num_layers=8, per_layer=(local,) * 5 + (glob,) + (local,) * 2)
    assert cfg.layer_groups == (LayerGroup(local, 0, 5), LayerGroup(glob, 5, 6),
                                LayerGroup(local, 6, 8))
    with pytest.raises(ConfigError, match="3 layer specs for num_hidden_layers=8"):
        tiny_config(num_layers=8, per_layer=(local,) * 3)
    with pytest.raises(ConfigError, match="hidden_act='relu' is not supported"):
        tiny_config(per_layer=(LayerSpec(mlp_activation="relu"),) * 2)
