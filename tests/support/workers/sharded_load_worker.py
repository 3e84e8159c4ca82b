"""Runs in a subprocess with 8 virtual CPU devices (XLA_FLAGS set by the caller): tiny models
saved as HF safetensors, jaxserve Orbax and GGUF, loaded straight onto TP 2 / 4 meshes, printed
as one JSON document for tests/models/test_sharded_loading.py.

Per (model, format, tp): whether every leaf equals the reference path
(`place_params(load_model(path).params)`) exactly and has the same sharding, the bytes of the
params on each device, and, for the host-sliced formats, every box the loader asked of each
checkpoint tensor (recorded by wrapping the tensors that `load_model` reads), and whether
placing the loaded params again (as `build_engine` does) leaves them as they are. Plus the
greedy tokens of a TP 4 engine over a GGUF loaded straight onto its mesh, and of TP 1.
The loads are float (quantization none: the per-device reads); the engine's GGUF keeps its
quant blocks (quantization auto).
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

import gguf
import jax
import numpy as np
from support.engine_fixtures import tiny_engine, tiny_model  # noqa: E402 - run with tests/ on the path
from support.hf_models import save_tiny_tokenizer

from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.models import loading, placement
from jaxserve.models.gguf_loader import LazyGGUF
from jaxserve.models.hf_loader import hf_tensors_from_params, save_hf_dir
from jaxserve.models.loading import LoadedModel
from jaxserve.models.quant import QuantizedWeight, WeightQuant

# The float path: every leaf read per device from the checkpoint (GGUF blocks dequantized).
# Quantized fields are assembled on the host per field (models/quantized_params.py) instead.
FLOAT = WeightQuant("none")

MODELS = {  # heads 8 / KV heads 2: TP 4 replicates each KV head twice
    "llama_bias": dict(num_heads=8, num_kv_heads=2, head_dim=8, hidden_size=64,
                       intermediate_size=128, vocab_size=256, attention_bias=True),
    "qwen3_tied": dict(model_type="qwen3", num_heads=8, num_kv_heads=2, head_dim=8,
                       hidden_size=64, intermediate_size=128, vocab_size=211, qk_norm=True,
                       tie_word_embeddings=True),
}
Q = gguf.GGMLQuantizationType


class Recorder:
    """A checkpoint tensor that logs the shape of every box read from it."""

    def __init__(self, name: str, base: object, log: list) -> None:
        self.name, self.base, self.log = name, base, log
        self.shape, self.dtype = tuple(base.shape), base.dtype  # type: ignore[attr-defined]

    def __getitem__(self, box: object) -> np.ndarray:
        out = np.asarray(self.base[box])  # type: ignore[index]
        self.log.append([self.name, list(out.shape), list(self.shape)])
        return out


def save_gguf(path: pathlib.Path, model: LoadedModel) -> None:
    """The model as a llama-arch GGUF: q/k rows permuted as llama.cpp does, mixed quant types."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in {"block_count": cfg.num_layers, "context_length": 256,
                       "embedding_length": cfg.hidden_size,
                       "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_heads,
                       "attention.head_count_kv": cfg.num_kv_heads,
                       "rope.dimension_count": cfg.head_dim, "vocab_size": cfg.vocab_size}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32("llama.rope.freq_base", cfg.rope_theta)
    writer.add_tokenizer_model("gpt2")
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab"]
    writer.add_token_list(tokens + [f"w{i}" for i in range(len(tokens), cfg.vocab_size)])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    blk = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for hf, w in hf_tensors_from_params(cfg, model.params).items():
        w = np.asarray(w, np.float32)
        if hf in top:
            name = top[hf]
        else:
            _, _, layer, rest = hf.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{layer}.{blk[module]}.{kind}"
        heads = cfg.num_heads if ".q_proj." in hf else cfg.num_kv_heads if ".k_proj." in hf else 0
        if heads:  # llama.cpp interleaves each head's two RoPE halves
            w = w.reshape(heads, 2, -1, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        # Quantized linears: Q8_0 (block 32) for attention, Q4_0 for the MLP, F16 embeddings;
        # TP 4 cuts o_proj's 64 columns into 16, inside one 32-wide block.
        qtype = (Q.F32 if w.ndim == 1 else Q.Q4_0 if "mlp." in hf else
                 Q.F16 if hf in top else Q.Q8_0)
        if qtype == Q.F32:
            writer.add_tensor(name, w)
        elif qtype == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def save_all(root: pathlib.Path, name: str) -> dict[str, pathlib.Path]:
    model = tiny_model(**MODELS[name])
    hf = root / f"{name}-hf"
    save_hf_dir(hf, model.config, model.params)
    save_tiny_tokenizer(hf, model.config.vocab_size)
    paths = {"hf": hf, "orbax": loading.convert(hf, root / f"{name}-orbax", fmt="orbax")}
    if model.config.model_type == "llama":
        paths["gguf"] = root / f"{name}.gguf"
        save_gguf(paths["gguf"], model)
    return paths


def recorded_load(path: pathlib.Path, mesh: jax.sharding.Mesh, log: list,
                  quant: WeightQuant = FLOAT) -> LoadedModel:
    """`load_model(path, mesh=mesh, quant=quant)` with every checkpoint tensor it reads wrapped
    in a Recorder."""
    real_hf, real_gguf = loading.read_hf_tensors, loading.open_gguf

    def hf_tensors(d: pathlib.Path) -> dict:
        return {k: Recorder(k, v, log) for k, v in real_hf(d).items()}

    def gguf_file(f: pathlib.Path) -> LazyGGUF:
        g = real_gguf(f)
        return LazyGGUF(g.source, g.hf_config, {k: Recorder(k, v, log)  # type: ignore[misc]
                                                for k, v in g.tensors.items()}, g.tensor_types)

    loading.read_hf_tensors, loading.open_gguf = hf_tensors, gguf_file  # type: ignore[assignment]
    try:
        return loading.load_model(path, mesh=mesh, quant=quant)
    finally:
        loading.read_hf_tensors, loading.open_gguf = real_hf, real_gguf


def device_bytes(params: object) -> list[int]:
    leaves = jax.tree.leaves(params)
    return [sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == d)
            for d in jax.devices()]


def check(name: str, fmt: str, path: pathlib.Path, tp: int) -> dict:
    mesh = placement.make_tp_mesh(tp)
    log: list = []
    got = recorded_load(path, mesh, log)
    ref_model = loading.load_model(path, quant=FLOAT)
    ref = placement.place_params(ref_model.params, ref_model.config, mesh)
    mismatched = []
    for (kp, a), b in zip(jax.tree_util.tree_leaves_with_path(got.params), jax.tree.leaves(ref)):
        same = (a.shape == b.shape and a.dtype == b.dtype
                and a.sharding.is_equivalent_to(b.sharding, a.ndim)
                and np.array_equal(np.asarray(a), np.asarray(b)))
        if not same:
            mismatched.append(jax.tree_util.keystr(kp))
    again = placement.place_params(got.params, got.config, mesh)  # what build_engine then does
    idempotent = all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(got.params)))
    return {"model": name, "format": fmt, "tp": tp, "mismatched": mismatched,
            "idempotent": idempotent,
            "same_tree": jax.tree.structure(got.params) == jax.tree.structure(ref),
            "device_bytes": device_bytes(got.params)[:tp], "total_bytes": sum(
                x.nbytes for x in jax.tree.leaves(got.params)),
            "reads": log, "config": {k: getattr(got.config, k) for k in (
                "num_layers", "hidden_size", "intermediate_size", "vocab_size", "num_heads",
                "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias", "qk_norm")}}


def greedy_tokens(model: LoadedModel, tp: int) -> list[int]:
    """An engine over `model` (compiling only the buckets it meets): 8 greedy tokens."""
    eng = tiny_engine(model, warmup=False, tensor_parallel_size=tp)
    eng.add_request("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=8,
                                                         ignore_eos=True))
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                return list(out.outputs[0].token_ids)
    raise AssertionError("the request never finished")


def engine_over_sharded_load(path: pathlib.Path, tp: int) -> dict:
    """An engine over a model loaded straight onto its TP mesh generates the TP 1 tokens. The
    GGUF's Q8_0 / Q4_0 blocks load as they are stored (quantization auto): 32-row groups over
    16 rows per device keep their scales whole on each device (placement._quant_spec)."""
    sharded = loading.load_model(path, mesh=placement.make_tp_mesh(tp))
    return {"tp1": greedy_tokens(loading.load_model(path), 1),
            "sharded_load": greedy_tokens(sharded, tp),
            "quantized": [f for f in ("wq", "wo", "w_down")
                          if isinstance(getattr(sharded.params.layers, f), QuantizedWeight)]}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxserve-shload-") as tmp:
        for name in MODELS:
            paths = save_all(pathlib.Path(tmp), name)
            for fmt, path in paths.items():
                rows.extend(check(name, fmt, path, tp) for tp in (2, 4))
            if name == "llama_bias":
                engine = engine_over_sharded_load(paths["gguf"], 4)
    json.dump({"loads": rows, "engine_tp4": engine}, sys.stdout)
