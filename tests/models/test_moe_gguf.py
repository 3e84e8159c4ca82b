"""MoE GGUF files (llama.cpp's qwen3moe, qwen2moe, and Mixtral as `llama` with experts)
against transformers.

Each model is built at random by transformers (support.hf_models' MOE_ARCHS at the tiny GGUF
vocabulary), written as llama.cpp's converter writes it (support.moe_gguf: merged
`ffn_*_exps` tensors, gguf-py's names, the converter's metadata keys, Mixtral's q/k rows
permuted), in F32 and with the weights quantized (Q8_0; Mixtral Q4_0). Oracle: transformers
loading an HF checkpoint of the values the file holds (gguf-py's dequantization of what was
written). Checked: the per-layer specs llama.cpp's conventions imply (Qwen3-MoE's and
Mixtral's top-k renormalised, Qwen2-MoE's not; the shared expert's width), full-sequence
logits within the bound of two float32 computations (support.numerics), the experts each
token selects equal transformers' router's on the same inputs, and the metadata refused with
the key named. Under quantization "auto" the stored blocks stay quantized, experts included
(Q8_0 -> int8, Q4_0 -> int4, groups of 32), run by the grouped matmul as they are.
Qwen3-MoE Q8_0 in the default tier; the other families and types in the slow tier.
"""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from support.gguf_files import TINY, Q  # noqa: E402
from support.hf_models import build_moe_model  # noqa: E402
from support.moe_gguf import save_oracle_dir, write_moe_gguf  # noqa: E402
from support.numerics import logits_atol  # noqa: E402
from support.tiers import run_slow  # noqa: E402

from jaxserve.models import decoder, loading, moe  # noqa: E402
from jaxserve.models.config import MoESpec  # noqa: E402
from jaxserve.models.quant import QuantizedWeight  # noqa: E402

PROMPT = [5, 17, 90, 3, 42, 8, 75, 7, 61, 33, 12, 88, 4, 60, 23]
CASES = [("qwen3_moe", "F32"), ("qwen3_moe", "Q8_0"), ("qwen2_moe", "F32"),
         ("qwen2_moe", "Q8_0"), ("mixtral", "F32"), ("mixtral", "Q4_0")]
DEFAULT_TIER = {("qwen3_moe", "Q8_0")}


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """(arch, qtype, the GGUF path, transformers' model of the values the file holds)."""
    arch, qname = request.param
    if request.param not in DEFAULT_TIER and not run_slow():
        pytest.skip("slow tier: this family / type (JAXSERVE_RUN_SLOW=1)")
    d = tmp_path_factory.mktemp(f"{arch}-{qname}")
    build_moe_model(arch, d / "hf", overrides=dict(vocab_size=TINY["vocab"]))
    # The Qwen2-MoE Q8_0 file stores its shared-expert gate [hidden], as quantized files do.
    held = write_moe_gguf(d / "hf", d / "model.gguf", getattr(Q, qname),
                          squeeze_shared_gate=arch == "qwen2_moe" and qname != "F32")
    oracle = transformers.AutoModelForCausalLM.from_pretrained(
        save_oracle_dir(d / "hf", d / "oracle", held), dtype=torch.float32).eval()
    return arch, qname, d / "model.gguf", oracle


def test_specs_follow_llama_cpp(case) -> None:  # noqa: ANN001
    arch, _, path, _ = case
    cfg = loading.load_model(path, quant=loading.WeightQuant("none")).config
    assert cfg.model_type == arch
    specs = cfg.layer_specs
    # qwen3_moe: layer 1 dense (the HF model's mlp_only_layers), read from its tensors
    sparse = [True, False, True] if arch == "qwen3_moe" else [True] * cfg.num_layers
    assert [s.moe is not None for s in specs] == sparse
    want = {"qwen3_moe": MoESpec(4, 2, 32, True), "qwen2_moe": MoESpec(4, 2, 32, False, 48),
            "mixtral": MoESpec(4, 2, 32, True)}[arch]
    assert specs[0].moe == want
    assert specs[0].qk_norm == (arch == "qwen3_moe") and cfg.attention_bias == (
        arch == "qwen2_moe")


def test_logits_and_routing_match_transformers(case) -> None:  # noqa: ANN001
    arch, qname, path, oracle = case
    ours = loading.load_model(path)  # "auto": stored quantization kept, experts included
    scheme = {"F32": None, "Q8_0": "int8", "Q4_0": "int4"}[qname]
    for field in moe.EXPERT_FIELDS:
        w = getattr(ours.params.layers, field)
        assert (w.scheme, w.group_size) == (scheme, 32) if scheme else not isinstance(
            w, QuantizedWeight), (field, type(w))
    tokens = np.array([PROMPT], np.int32)
    got = np.asarray(decoder.forward_jit(ours.params, tokens, np.array([len(PROMPT)], np.int32),
                                         cfg=ours.config))
    routers = [(n, m) for n, m in oracle.named_modules() if type(m).__name__.endswith("Router")]
    seen: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def hook(name: str):  # noqa: ANN202
        def f(mod, args, out) -> None:  # noqa: ANN001
            seen[name] = (args[0].reshape(-1, args[0].shape[-1]).numpy(), out[2].numpy())
        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in routers]
    try:
        with torch.no_grad():
            want = oracle(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    finally:
        for h in handles:
            h.remove()
    err = float(np.max(np.abs(got - want)))
    print(f"{arch} {qname}: max|diff| = {err:.2e}")
    assert err <= logits_atol(ours.config, ours.params, tokens.shape[1])
    assert len(seen) == sum(s.moe is not None for s in ours.config.layer_specs) > 0
    for name, (x, idx) in seen.items():
        layer = int(name.split(".layers.")[1].split(".")[0])
        w, e = moe.route(ours.config.layer_specs[layer].moe, ours.params.layers.router[layer],
                         jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(e), idx, err_msg=f"{arch} {name}")


@pytest.mark.parametrize("meta, match", [
    ({"qwen3moe.expert_gating_func": 2}, "expert_gating_func=2"),
    ({"qwen3moe.expert_used_count": 9}, "expert_used_count=9"),
])
def test_refused_metadata_names_the_key(tmp_path: pathlib.Path, meta: dict, match: str) -> None:
    from support.gguf_files import tiny_weights, write_tiny_gguf

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, tiny_weights(np.random.default_rng(0), "qwen3"), arch="qwen3moe",
                    meta_override={"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2,
                                   **meta})
    with pytest.raises(ValueError, match=match):
        loading.load_model(path)


def test_moe_metadata_defaults_are_llama_cpps() -> None:
    """What a file leaves unsaid is llama.cpp's choice: Qwen3-MoE (and llama / Mixtral)
    renormalise the top-k, Qwen2-MoE does not, unless `expert_weights_norm` says; experts of
    feed_forward_length / expert_used_count without `expert_feed_forward_length`; the shared
    expert feed_forward_length wide; dense layers where a layer has no router tensor."""
    from jaxserve.models import families, moe_gguf

    def fields(arch: str, **meta: object) -> dict:
        md = {"embedding_length": 64, "attention.head_count": 4, "block_count": 2,
              "feed_forward_length": 96, "attention.layer_norm_rms_epsilon": 1e-6,
              "context_length": 256, "expert_count": 4, "expert_used_count": 2, **meta}

        def key(name: str, default: object = None, required: bool = False,
                kind: type = int) -> object:
            return md.get(name, default)

        names = {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_shexp.weight",
                 "blk.1.ffn_gate_shexp.weight"}
        model_type = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}[arch]
        if arch == "qwen3moe":
            names = {n for n in names if "shexp" not in n}
        d = families.family_for_gguf(arch, "x")[0].config_dict_from_gguf(key, names, model_type)
        return dict(d, vocab_size=64)

    q3 = families.config_from_hf(fields("qwen3moe"))
    assert [s.moe is not None for s in q3.layer_specs] == [True, False]  # layer 1: no router
    assert q3.layer_specs[0].moe == MoESpec(4, 2, 48, True)
    assert families.config_from_hf(fields("qwen3moe", expert_weights_norm=False)
                                   ).layer_specs[0].moe.norm_topk_prob is False
    q2 = families.config_from_hf(fields("qwen2moe", expert_feed_forward_length=32))
    assert q2.layer_specs[0].moe == MoESpec(4, 2, 32, False, 96)
    assert moe_gguf.GGUF_EXPERT_FIELDS == {
        f"{gguf.TENSOR_NAMES[t].split('.')[-1]}.weight": f for t, f in (
            (gguf.MODEL_TENSOR.FFN_GATE_EXP, "we_gate"), (gguf.MODEL_TENSOR.FFN_UP_EXP, "we_up"),
            (gguf.MODEL_TENSOR.FFN_DOWN_EXP, "we_down"))}
