"""Runs in a subprocess with 8 virtual CPU devices (XLA_FLAGS set by the caller): tiny
compressed-tensors checkpoints loaded straight onto a TP 2 mesh, printed as one JSON document
for tests/models/test_compressed_tensors.py.

Per variant: the logits of the TP 2 load against the TP 1 load's, the leaves that differ from
the TP 1 params placed on the mesh (values, scales and their shardings), every box the loader
read of the stored values (recorded as `sharded_load_worker` records them: each must be one
device's slice), and the greedy tokens of a TP 2 and a TP 1 engine over the checkpoint.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

import jax
import numpy as np
from support.compressed_ckpt import write_compressed  # noqa: E402 - run with tests/ on the path
from support.hf_models import build_hf_model, save_tiny_tokenizer
from support.numerics import logits_atol
from support.workers.sharded_load_worker import greedy_tokens, recorded_load

from jaxserve.models import decoder, loading, placement
from jaxserve.models.quant import WeightQuant

TOKENS = np.array([[5, 17, 99, 3, 42, 8, 150, 7]], np.int32)
VARIANTS = {"fp8_dynamic": ("fp8", "channel", False, "fp8", ("lm_head",)),
            "w8a16_packed_tensor": ("int8", "tensor", True, None, ())}
COLUMN_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # [out, in]: out split


def logits(model: loading.LoadedModel, cfg: object) -> np.ndarray:
    return np.asarray(decoder.forward_jit(model.params, TOKENS, np.array([8], np.int32), cfg=cfg))


def value_reads(log: list, tp: int) -> tuple[int, list]:
    """(how many reads of stored linear values, those not exactly one device's slice: [out / tp,
    in] for a column-split linear, [out, in / tp] for a row-split one; int32 words if packed)."""
    bad, n = [], 0
    for name, got, full in log:
        if not name.endswith((".weight", ".weight_packed")) or "_proj" not in name:
            continue
        n += 1
        split = 0 if name.rsplit(".", 2)[-2] in COLUMN_SPLIT else 1
        want = list(full)
        want[split] //= tp
        if got != want:
            bad.append([name, got, full])
    return n, bad


def check(variant: str, root: pathlib.Path, src: pathlib.Path) -> dict:
    dst = root / variant
    write_compressed(src, dst, *VARIANTS[variant])
    one = loading.load_model(dst)
    mesh = placement.make_tp_mesh(2)
    log: list = []
    two = recorded_load(dst, mesh, log, WeightQuant())  # auto: the stored scheme
    ref = placement.place_params(one.params, one.config, mesh)
    mismatched = [jax.tree_util.keystr(kp) for (kp, a), b in zip(
        jax.tree_util.tree_leaves_with_path(two.params), jax.tree.leaves(ref))
        if not (a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim)
                and np.array_equal(np.asarray(a), np.asarray(b)))]
    want, got = logits(one, one.config), logits(two, placement.tp_model_config(two.config, 2))
    wq = two.params.layers.wq
    n_reads, bad = value_reads(log, 2)
    return {"variant": variant, "mismatched": mismatched,
            "same_tree": jax.tree.structure(two.params) == jax.tree.structure(ref),
            "quantized": type(wq).__name__ == "QuantizedWeight",
            "values_shard": list(wq.values.addressable_shards[0].data.shape),
            "values_shape": list(wq.values.shape),
            # TP 2's row-split partial sums are another summation order: logits_atol.
            "logits_err": float(np.max(np.abs(got - want))),
            "logits_atol": logits_atol(one.config, one.params, TOKENS.shape[1]),
            "value_reads": n_reads, "bad_reads": bad,
            "tokens_tp1": greedy_tokens(one, 1), "tokens_tp2": greedy_tokens(two, 2)}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    with tempfile.TemporaryDirectory(prefix="jaxserve-ct-tp-") as tmp:
        root = pathlib.Path(tmp)
        src = root / "src"  # 8 heads, 2 KV heads, untied lm_head, vocab 211 (replicated)
        build_hf_model("llama3_gqa_rope_scaling", src)
        save_tiny_tokenizer(src, 211)
        rows = [check(v, root, src) for v in VARIANTS]
    json.dump({"rows": rows}, sys.stdout)
