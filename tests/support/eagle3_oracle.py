"""An EAGLE-3 head in plain PyTorch (CPU, float32), written from the architecture: the oracle
of `jaxserve.models.eagle3`, and the random checkpoints the tests load.

`write_head(dir, ...)` saves random small weights as safetensors under the released key names
(linear weights [out, in], `d2t` int64 offsets and `t2d` a bool mask, as the EAGLE authors'
training code writes them) plus a config.json; `reference(weights, cfg, tokens, aux)` runs the
head densely over one whole sequence (causal attention, no pages): fc over the auxiliary
hidden states, then the midlayer on concat(input_layernorm(embed), hidden_norm(hidden)) with
the raw hidden as the residual, and returns (pre-norm output, draft logits). Nothing here
imports jaxserve's model code.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
from safetensors.numpy import save_file

# The head under test: hidden 32 as the suite's engine model (`tiny.TEST_SHAPE`), 4 query /
# 2 KV heads of 8, a reduced draft vocabulary of 50 out of 211.
HEAD_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
    "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 48, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 512, "hidden_act": "silu",
    "vocab_size": 211, "draft_vocab_size": 50, "tie_word_embeddings": False,
}


def random_weights(cfg: dict, seed: int = 0, embed: bool = True) -> dict[str, np.ndarray]:
    """Released-layout tensors: norms near 1, linears of unit-ish output scale."""
    rng = np.random.default_rng(seed)
    H, I, V, Vd = (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"],
                   cfg["draft_vocab_size"])
    Ht = cfg.get("target_hidden_size", H)
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]

    def lin(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    hot = np.sort(rng.choice(V, Vd, replace=False))  # the draft vocabulary's target ids
    t2d = np.zeros(V, bool)
    t2d[hot] = True
    w = {"fc.weight": lin(H, 3 * Ht),
         "midlayer.input_layernorm.weight": norm(H), "midlayer.hidden_norm.weight": norm(H),
         "midlayer.self_attn.q_proj.weight": lin(q, 2 * H),
         "midlayer.self_attn.k_proj.weight": lin(kv, 2 * H),
         "midlayer.self_attn.v_proj.weight": lin(kv, 2 * H),
         "midlayer.self_attn.o_proj.weight": lin(H, q),
         "midlayer.post_attention_layernorm.weight": norm(H),
         "midlayer.mlp.gate_proj.weight": lin(I, H), "midlayer.mlp.up_proj.weight": lin(I, H),
         "midlayer.mlp.down_proj.weight": lin(H, I), "norm.weight": norm(H),
         "lm_head.weight": lin(Vd, H), "d2t": (hot - np.arange(Vd)).astype(np.int64),
         "t2d": t2d}
    if embed:
        w["embed_tokens.weight"] = rng.standard_normal((V, H)).astype(np.float32)
    return w


def write_head(out: pathlib.Path, cfg: dict, weights: dict[str, np.ndarray]) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(out / "model.safetensors"))
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D], rotate-half layout."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = (pos.double()[:, None] * inv[None, :]).float()  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def reference(weights: dict[str, np.ndarray], cfg: dict, tokens: np.ndarray,
              hidden_in: np.ndarray | None = None, aux: np.ndarray | None = None,
              embed_table: np.ndarray | None = None, norm_before_residual: bool = False
              ) -> tuple[np.ndarray, np.ndarray]:
    """One sequence: tokens [T], the hidden input [T, H] (or aux [T, 3 Ht] through fc) ->
    (pre-norm output [T, H], draft logits [T, draft_vocab])."""
    w = {k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()}
    eps, nh, nkv, D = (cfg["rms_norm_eps"], cfg["num_attention_heads"],
                       cfg["num_key_value_heads"], cfg["head_dim"])
    T = len(tokens)
    pos = torch.arange(T)
    table = w["embed_tokens.weight"] if embed_table is None else torch.from_numpy(embed_table)
    e = table[torch.from_numpy(np.asarray(tokens, np.int64))]
    h = (torch.from_numpy(aux) @ w["fc.weight"].T if hidden_in is None
         else torch.from_numpy(hidden_in))
    m = "midlayer."
    hn = _rms(h, w[m + "hidden_norm.weight"], eps)
    x = torch.cat([_rms(e, w[m + "input_layernorm.weight"], eps), hn], -1)
    q = (x @ w[m + "self_attn.q_proj.weight"].T).view(T, nh, D)
    k = (x @ w[m + "self_attn.k_proj.weight"].T).view(T, nkv, D)
    v = (x @ w[m + "self_attn.v_proj.weight"].T).view(T, nkv, D)
    q, k = _rope(q, pos, cfg["rope_theta"]), _rope(k, pos, cfg["rope_theta"])
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / D ** 0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, nh * D)
    r = (hn if norm_before_residual else h) + o @ w[m + "self_attn.o_proj.weight"].T
    g = _rms(r, w[m + "post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(g @ w[m + "mlp.gate_proj.weight"].T)
           * (g @ w[m + "mlp.up_proj.weight"].T)) @ w[m + "mlp.down_proj.weight"].T
    out = r + mlp
    head = w["lm_head.weight"] if "lm_head.weight" in w else table  # tied: the embedding
    logits = _rms(out, w["norm.weight"], eps) @ head.T
    return out.numpy(), logits.numpy()
