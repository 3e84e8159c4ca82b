"""The EAGLE-3 draft head: load a released head checkpoint, run it over its own paged KV.

Data flow (one draft step, pure, jit with `cfg` static):
  first draft token of a row: the target step's auxiliary hidden states f[T, 3 * Ht]
  (`paged.paged_hidden(..., aux_layers=cfg.aux_layers(target))`) -> `eagle3_fuse` (fc) ->
  hidden f[T, H]; later draft tokens: the head's own previous output hidden.
  `eagle3_hidden(token_ids, hidden, positions, md)`: the midlayer on
    attention input concat(input_layernorm(embed(token)), hidden_norm(hidden)) f[T, 2H]
    (q/k/v read 2H; RoPE at each token's position; the new K/V written into the head's pages
    at `md.slot_mapping`, then ragged paged attention over `md.block_tables`),
    residual = hidden (the raw input; `norm_before_residual`: hidden_norm(hidden)),
    r = residual + o_proj(attn); out = r + mlp(post_attention_layernorm(r))
  -> (out f[T, H], updated pages). `out` is the pre-norm stream vLLM and SGLang feed back as
  the next draft token's hidden input; `eagle3_logits` applies the final `norm` and `lm_head`
  -> f32[rows, draft_vocab] (times `logit_scale`), and `draft_to_target` maps a draft id d to
  the target id d + d2t[d].
How vLLM's proposer drives it (what a runner does with these functions): after a target step,
the head runs over the same rows at the same positions and slots, each row pairing the
target's hidden state of position p with the token of position p + 1 (the step's token ids
shifted left by one within each sequence, its last row the token just sampled); draft logits
are taken at each sequence's last row. Each later draft token is one more row per sequence at
the next position, its token the previous draft (a target-vocabulary id, via
`draft_to_target`) and its hidden the previous row's output. Token ids are always target ids.
The token embedding is the head's own `embed_tokens.weight` when the checkpoint has one, else
the target's (passed as `target_embed`: any embed `blocks.embed` reads, packed or quantized);
a tied head (`tie_word_embeddings`, draft vocabulary = target's) uses that same table as its
lm_head.

KV: one layer's pages f[num_pages, 2 * Hkv, page_size, D] (`init_eagle3_kv`), addressed by the
target's block tables and slot mapping (same page ids: the head's page p holds the same
tokens as the target's page p, so it is preempted and freed with them; page 0 is trash).
The array is updated in place when donated (one scatter, no slice). A target with KV groups
(sliding-window layers) has per-group tables; the head is refused there for now.

Checkpoint: `config.json` (`eagle3_config`) and safetensors with the released key names
(`HF_NAMES`); linear weights are stored [out, in] and transposed to [in, out] here. `t2d`
(the reverse map, a bool mask over the target vocabulary) is checked and dropped, as vLLM and
SGLang drop it. Missing, unknown and misshapen tensors are refused naming them.
"""

from __future__ import annotations

import pathlib
import types
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..kernels_pallas import AttentionMetadata, KVPages, QuantizedKV, init_kv_pages
from ..kernels_pallas import write_kv_and_attend
from .blocks import attention, embed, gated_mlp, lm_logits, rms_norm
from .eagle3_config import NUM_AUX, Eagle3Config, eagle3_config_from_hf
from .hf_loader import _read_json_object, read_hf_tensors
from .safetensors_io import CheckpointError


@struct.dataclass
class Eagle3Params:
    """One head's weights, linear weights [in, out]; field names are those `blocks.attention`
    and `blocks.gated_mlp` read, so the params serve as the midlayer's layer params."""

    fc: jax.Array  # f[3 * target_hidden, hidden]
    attn_norm: jax.Array  # f[hidden]  midlayer.input_layernorm (on the token embedding)
    hidden_norm: jax.Array  # f[hidden]  midlayer.hidden_norm (on the hidden input)
    wq: jax.Array  # f[2 * hidden, num_heads * head_dim]
    wk: jax.Array  # f[2 * hidden, num_kv_heads * head_dim]
    wv: jax.Array  # f[2 * hidden, num_kv_heads * head_dim]
    wo: jax.Array  # f[num_heads * head_dim, hidden]
    mlp_norm: jax.Array  # f[hidden]  midlayer.post_attention_layernorm
    w_gate: jax.Array  # f[hidden, intermediate]
    w_up: jax.Array  # f[hidden, intermediate]
    w_down: jax.Array  # f[intermediate, hidden]
    final_norm: jax.Array  # f[hidden]  norm
    d2t: jax.Array  # i32[draft_vocab]  target id of draft id d = d + d2t[d]
    lm_head: jax.Array | None = None  # f[hidden, draft_vocab]; None: tied to the embedding
    embed: jax.Array | None = None  # f[vocab, hidden]; None: the target's is used


# Params field -> (released checkpoint name, linear weight stored [out, in] to transpose).
HF_NAMES: dict[str, tuple[str, bool]] = {
    "fc": ("fc.weight", True),
    "attn_norm": ("midlayer.input_layernorm.weight", False),
    "hidden_norm": ("midlayer.hidden_norm.weight", False),
    "wq": ("midlayer.self_attn.q_proj.weight", True),
    "wk": ("midlayer.self_attn.k_proj.weight", True),
    "wv": ("midlayer.self_attn.v_proj.weight", True),
    "wo": ("midlayer.self_attn.o_proj.weight", True),
    "mlp_norm": ("midlayer.post_attention_layernorm.weight", False),
    "w_gate": ("midlayer.mlp.gate_proj.weight", True),
    "w_up": ("midlayer.mlp.up_proj.weight", True),
    "w_down": ("midlayer.mlp.down_proj.weight", True),
    "final_norm": ("norm.weight", False),
    "lm_head": ("lm_head.weight", True),
    "embed": ("embed_tokens.weight", False),
    "d2t": ("d2t", False),
}
T2D = "t2d"
_INT_FIELDS = ("d2t",)


def param_shapes(cfg: Eagle3Config, has_embed: bool) -> dict[str, tuple[int, ...]]:
    """Params field -> shape (as stored in Eagle3Params, [in, out]) for fields present."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    shapes = {"fc": (NUM_AUX * cfg.target_hidden_size, H), "attn_norm": (H,),
              "hidden_norm": (H,), "wq": (2 * H, cfg.q_size), "wk": (2 * H, cfg.kv_size),
              "wv": (2 * H, cfg.kv_size), "wo": (cfg.q_size, H), "mlp_norm": (H,),
              "w_gate": (H, I), "w_up": (H, I), "w_down": (I, H), "final_norm": (H,),
              "d2t": (cfg.draft_vocab_size,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (H, cfg.draft_vocab_size)
    if has_embed:
        shapes["embed"] = (cfg.vocab_size, H)
    return shapes


def params_from_tensors(cfg: Eagle3Config, tensors: Mapping[str, np.ndarray],
                        dtype: Any = jnp.float32, source: str = "checkpoint") -> Eagle3Params:
    """{released name: array} -> Eagle3Params in `dtype` (d2t int32). Refuses, naming the
    tensors: unknown names, missing ones, wrong shapes, a d2t that maps outside the target
    vocabulary. `d2t` may be absent only when the draft vocabulary is the target's (the
    identity map, as vLLM's zero-filled default); `t2d` is checked and dropped."""
    has_embed = HF_NAMES["embed"][0] in tensors
    shapes = param_shapes(cfg, has_embed)
    known = {HF_NAMES[f][0] for f in shapes} | {T2D}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise CheckpointError(f"{source}: tensors an EAGLE-3 head does not have: {unknown[:8]}")
    optional = {"d2t"} if cfg.draft_vocab_size == cfg.vocab_size else set()
    missing = sorted(HF_NAMES[f][0] for f in shapes if HF_NAMES[f][0] not in tensors
                     and f not in optional)
    if missing:
        raise CheckpointError(f"{source}: missing tensors of the EAGLE-3 head: {missing}")
    if T2D in tensors and tuple(tensors[T2D].shape) != (cfg.vocab_size,):
        raise CheckpointError(f"{source}: t2d has shape {tuple(tensors[T2D].shape)}, expected "
                              f"({cfg.vocab_size},) (vocab_size)")
    out: dict[str, jax.Array] = {}
    for field, shape in shapes.items():
        name, transpose = HF_NAMES[field]
        if name not in tensors:  # an absent d2t: the identity
            out[field] = jnp.zeros(shape, jnp.int32)
            continue
        a = np.asarray(tensors[name])
        got = a.shape[::-1] if transpose and a.ndim == 2 else a.shape
        if tuple(got) != shape:
            stored = shape[::-1] if transpose else shape
            raise CheckpointError(f"{source}: {name} has shape {tuple(a.shape)}, expected "
                                  f"{stored}")
        if field in _INT_FIELDS:
            if not np.issubdtype(a.dtype, np.integer):
                raise CheckpointError(f"{source}: {name} has dtype {a.dtype}, expected integers")
            target = np.arange(a.shape[0]) + a.astype(np.int64)
            if a.size and (target.min() < 0 or target.max() >= cfg.vocab_size):
                raise CheckpointError(f"{source}: {name} maps draft ids outside the target "
                                      f"vocabulary [0, {cfg.vocab_size})")
            out[field] = jnp.asarray(a, jnp.int32)
        else:
            out[field] = jnp.asarray((a.T if transpose else a).astype(np.float32), dtype)
    return Eagle3Params(**out)


def load_eagle3(path: str | pathlib.Path, dtype: Any = jnp.float32
                ) -> tuple[Eagle3Config, Eagle3Params]:
    """A head directory (config.json + safetensors) -> (config, params). Check it against the
    target with `cfg.check_target(target_cfg, params.embed is not None)`."""
    path = pathlib.Path(path)
    config = path / "config.json"
    if not config.exists():
        raise CheckpointError(f"{path}: no config.json (not an EAGLE-3 head directory)")
    cfg = eagle3_config_from_hf(_read_json_object(config), str(config))
    return cfg, params_from_tensors(cfg, read_hf_tensors(path), dtype, str(path))


def init_eagle3_kv(cfg: Eagle3Config, num_pages: int, page_size: int, dtype: Any,
                   head_dim: int | None = None) -> KVPages:
    """Zeroed pages of the head's one layer, as many as the target has per layer."""
    return init_kv_pages(num_pages, page_size, cfg.num_kv_heads, head_dim or cfg.head_dim,
                         dtype)


def eagle3_fuse(params: Eagle3Params, aux: jax.Array) -> jax.Array:
    """fc: the target's auxiliary hidden states f[..., 3 * Ht] -> the head's hidden f[..., H]."""
    return jnp.einsum("...i,io->...o", aux, params.fc.astype(aux.dtype))


def _embed_params(params: Eagle3Params, target_embed: Any) -> Any:
    table = params.embed if params.embed is not None else target_embed
    if table is None:
        raise ValueError("the EAGLE-3 head has no embed_tokens.weight: pass the target's "
                         "embedding as target_embed")
    # What `blocks.embed` / `blocks.lm_logits` read: the table, the head, the norms' dtype.
    return types.SimpleNamespace(embed=table, lm_head=params.lm_head,
                                 final_norm=params.final_norm)


def eagle3_hidden(params: Eagle3Params, kv_pages: KVPages, token_ids: jax.Array,
                  hidden: jax.Array, positions: jax.Array, md: AttentionMetadata,
                  cfg: Eagle3Config, target_embed: Any = None,
                  attn_impl: str = "reference") -> tuple[jax.Array, KVPages]:
    """token_ids i32[T], hidden f[T, H] (fc of the aux states, or the previous output),
    positions i32[T], md (the target's tables and slots) -> (f[T, H] the midlayer's output
    before the final norm, updated kv_pages). Pure; jit with cfg and attn_impl static."""
    if md.block_tables.ndim != 2:
        raise ValueError("the EAGLE-3 head reads one block table per sequence; a target with "
                         "KV groups (per-group tables) is not supported")
    lcfg = cfg.layer_config
    spec = lcfg.uniform_spec()
    eps = cfg.rms_norm_eps
    quantized = isinstance(kv_pages, QuantizedKV)

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, pages: KVPages,
               spec: Any) -> tuple[jax.Array, KVPages]:
        dt = q.dtype if quantized else pages.dtype  # as the target's step (`paged.py`)
        out, pages = write_kv_and_attend(q.astype(dt), k.astype(dt), v.astype(dt), pages, md,
                                         sm_scale=spec.query_scale, impl=attn_impl)
        return out.astype(q.dtype), pages

    hidden = hidden.astype(params.final_norm.dtype)
    e = embed(_embed_params(params, target_embed), token_ids)
    h = rms_norm(hidden, params.hidden_norm, eps)
    residual = h if cfg.norm_before_residual else hidden
    x = jnp.concatenate([rms_norm(e, params.attn_norm, eps), h], axis=-1)
    o, kv_pages, _ = attention(lcfg, spec, params, x, positions, attend, kv_pages)
    r = residual + o
    out = r + gated_mlp("silu", params, rms_norm(r, params.mlp_norm, eps))
    return out, kv_pages


def eagle3_logits(params: Eagle3Params, hidden: jax.Array, cfg: Eagle3Config,
                  target_embed: Any = None) -> jax.Array:
    """Rows of `eagle3_hidden`'s output f[R, H] -> f32[R, draft_vocab]: final norm, lm_head
    (the embedding when tied), times `logit_scale`."""
    logits = lm_logits(cfg.layer_config, _embed_params(params, target_embed), hidden)
    return logits if cfg.logit_scale == 1.0 else logits * cfg.logit_scale


def draft_to_target(params: Eagle3Params, draft_ids: jax.Array) -> jax.Array:
    """Draft vocabulary ids i32[...] -> target vocabulary ids (d + d2t[d])."""
    return draft_ids + params.d2t[draft_ids]
