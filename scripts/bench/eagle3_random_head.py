#!/usr/bin/env python
"""Write a randomly initialised EAGLE-3 head for a target model, in the released format
(config.json + model.safetensors, the key names vLLM and SGLang load), for benchmarks that
measure what serving a head costs: its proposals are junk (almost none accepted), so a run
with it gives the per-step price of EAGLE-3 here (the head's round, its K/V pages, the
pipeline applying every step first), not a speed-up. No trained head can be downloaded on
this machine.

    python scripts/bench/eagle3_random_head.py --target /tmp/smollm2-hf --out /tmp/eagle3-rand

The head has the target's layer shape (hidden size, heads, KV heads, head dim, MLP width),
a draft vocabulary of --draft-vocab target ids (the released Llama-3 heads: 32,000 of
128,256) and its own embedding table.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
from safetensors.numpy import save_file


def head_config(target: dict, draft_vocab: int) -> dict:
    hidden = target["hidden_size"]
    heads = target["num_attention_heads"]
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": target.get("num_key_value_heads", heads),
            "head_dim": target.get("head_dim") or hidden // heads,
            "intermediate_size": target["intermediate_size"], "num_hidden_layers": 1,
            "rms_norm_eps": target.get("rms_norm_eps", 1e-5),
            "rope_theta": target.get("rope_theta", 10000.0),
            "max_position_embeddings": target["max_position_embeddings"],
            "hidden_act": "silu", "vocab_size": target["vocab_size"],
            "draft_vocab_size": min(draft_vocab, target["vocab_size"]),
            "tie_word_embeddings": False}


def random_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    H, I, V, Vd = (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"],
                   cfg["draft_vocab_size"])
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]

    def lin(out: int, inp: int) -> np.ndarray:  # stored [out, in], unit-scale outputs
        return (rng.standard_normal((out, inp), np.float32) / np.sqrt(inp)).astype(np.float32)

    hot = np.sort(rng.choice(V, Vd, replace=False))  # the draft vocabulary's target ids
    t2d = np.zeros(V, bool)
    t2d[hot] = True
    m = "midlayer."
    return {"fc.weight": lin(H, 3 * H), m + "input_layernorm.weight": np.ones(H, np.float32),
            m + "hidden_norm.weight": np.ones(H, np.float32),
            m + "self_attn.q_proj.weight": lin(q, 2 * H),
            m + "self_attn.k_proj.weight": lin(kv, 2 * H),
            m + "self_attn.v_proj.weight": lin(kv, 2 * H),
            m + "self_attn.o_proj.weight": lin(H, q),
            m + "post_attention_layernorm.weight": np.ones(H, np.float32),
            m + "mlp.gate_proj.weight": lin(I, H), m + "mlp.up_proj.weight": lin(I, H),
            m + "mlp.down_proj.weight": lin(H, I), "norm.weight": np.ones(H, np.float32),
            "lm_head.weight": lin(Vd, H), "d2t": (hot - np.arange(Vd)).astype(np.int64),
            "t2d": t2d, "embed_tokens.weight": rng.standard_normal((V, H), np.float32) * 0.02}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target's HF folder (its config.json)")
    ap.add_argument("--out", required=True, help="the head's folder (created)")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    target = json.loads((pathlib.Path(args.target) / "config.json").read_text())
    cfg = head_config(target, args.draft_vocab)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(random_weights(cfg, args.seed), str(out / "model.safetensors"))
    print(f"random EAGLE-3 head for {args.target} -> {out}")


if __name__ == "__main__":
    main()
