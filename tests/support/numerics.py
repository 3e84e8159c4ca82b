"""Error bounds for comparing two float32 computations of the same model that differ only in
the order of their sums (a kernel against the reference, TP partial sums against one device).

Where a bound comes from: a sum of n float32 terms computed in any order lies within
gamma_n * sum|terms| of the exact sum, gamma_n = n*u / (1 - n*u), u = 2**-24 (Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 3.5 and section 4.2). Two
orders of the same sum therefore differ by at most 2 * gamma_n * sum|terms|, whatever the
SIMD width (AVX2's 8 lanes, AVX-512's 16), the blocking of a kernel or the number of TP
partial sums: each of those is only another summation order. A decoder's output passes
through a chain of such sums (norms, projections, attention, the MLP, the lm_head, the
log-softmax); to first order their relative errors add along the chain.

What is not covered: the magnitude sum|terms| is replaced by the largest |value| compared,
which underestimates it where sums cancel, and nonlinearities can amplify an upstream
error. The bounds below are therefore used with the exact-token assertions beside them (a
real defect, a wrong head or a missed page, moves values by O(1), far past these bounds).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

F32_UNIT_ROUNDOFF = 2.0 ** -24


def gamma(n: int, u: float = F32_UNIT_ROUNDOFF) -> float:
    """Higham's gamma_n: the relative error bound of an n-term float sum in any order."""
    if n * u >= 1:
        raise ValueError(f"gamma_n undefined for n={n} at u={u}")
    return n * u / (1 - n * u)


def reordered_chain_bound(reduction_lengths: Iterable[int], u: float = F32_UNIT_ROUNDOFF) -> float:
    """Relative difference bound between two summation orders of a chain of reductions: each
    stage of length n contributes 2 * gamma_n (both orders err, in opposite directions at
    worst), and first-order errors add along the chain."""
    return sum(2 * gamma(n, u) for n in reduction_lengths)


def decoder_reduction_lengths(*, hidden_size: int, intermediate_size: int, num_heads: int,
                              head_dim: int, num_layers: int, vocab_size: int,
                              context_len: int) -> list[int]:
    """The sums one logprob of a Llama-style decoder passes through, in order: per layer the
    input RMSNorm (hidden), q/k/v projection (hidden), scores (head_dim), softmax
    normaliser and probability-weighted values (context), o_proj (heads * head_dim), the
    post-attention RMSNorm (hidden), gate/up (hidden), down (intermediate); then the final
    norm (hidden), the lm_head (hidden) and the log-softmax's sum over the vocabulary."""
    layer = [hidden_size, hidden_size, head_dim, context_len, context_len,
             num_heads * head_dim, hidden_size, hidden_size, intermediate_size]
    return layer * num_layers + [hidden_size, hidden_size, vocab_size]


def logprob_tolerance(max_abs_ref: float, reduction_lengths: Iterable[int]) -> float:
    """Absolute tolerance for logprobs log p_k = z_k - logsumexp(z): an error e in the logits
    moves a logprob by at most 2e (once in z_k, once through the logsumexp), and the logits'
    error is at most the chain bound times their magnitude (max|ref| as its proxy). The
    additive 2**-20 covers values near zero, where a relative bound says nothing."""
    return 2 * reordered_chain_bound(reduction_lengths) * max_abs_ref + 2.0 ** -20


def model_reduction_lengths(cfg: object, context_len: int, *, logits: bool = False) -> list[int]:
    """decoder_reduction_lengths of a ModelConfig-like `cfg` (hidden_size, intermediate_size,
    num_heads, head_dim, num_layers, vocab_size); qk_norm models add a head_dim sum per
    layer; logits=True stops at the lm_head (no log-softmax over the vocabulary)."""
    lengths = decoder_reduction_lengths(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_heads=cfg.num_heads, head_dim=cfg.head_dim, num_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size, context_len=context_len)
    if getattr(cfg, "qk_norm", False):
        lengths += [cfg.head_dim] * cfg.num_layers
    return lengths[:-1] if logits else lengths


# Ulps of error assumed for one float32 exp / log / tanh / rsqrt / sin / cos of either side:
# XLA's vectorised CPU approximations, torch's (SLEEF / libm) and the C++ kernel's Cephes
# polynomial are each documented at 1-2 ulp; 4 is the budget used here. One ulp is at most
# 2u relative, so one such call errs by at most 2 * 4 * u relative.
TRANSCENDENTAL_ULPS = 4

# Transcendental stages one decoder layer's output passes through, each a relative error on
# what follows: the two RMSNorms' rsqrt, the attention softmax's exp (counted twice: the
# weights and their normaliser), SiLU's exp and RoPE's sin / cos. The final norm adds one.
TRANSCENDENTALS_PER_LAYER = 6


def transcendental_bound(stages: int, sides: int = 2) -> float:
    """Relative difference from `stages` transcendental calls evaluated by `sides` (2: two
    implementations, or one implementation on two slightly different arguments: the
    approximation error is not smooth, so both count)."""
    return stages * sides * 2 * TRANSCENDENTAL_ULPS * F32_UNIT_ROUNDOFF


def logits_rtol(cfg: object, context_len: int) -> float:
    """max|logits - ref| / max|ref| bound for two float32 runs of a decoder that differ in
    summation order and in transcendental implementations (jaxserve on XLA against
    transformers on torch, or two jaxserve layouts): reordered_chain_bound over the chain to
    the lm_head plus transcendental_bound over its stages, first order (see the module
    docstring for what the max|ref| proxy does not cover)."""
    stages = TRANSCENDENTALS_PER_LAYER * cfg.num_layers + 1
    return (reordered_chain_bound(model_reduction_lengths(cfg, context_len, logits=True))
            + transcendental_bound(stages) + family_chain_extra(cfg))


def family_chain_extra(cfg: object) -> float:
    """What a layer's spec adds to the Llama-shaped chain of logits_rtol (0 for Llama):
    Gemma's sandwich norms (`post_norms`: two more hidden-length sums and two rsqrt), GeGLU's
    tanh, the attention soft-cap's tanh (soft-caps are 1-Lipschitz: they carry errors on
    without growing them), the qk-norm's two rsqrt, Gemma 4's value norm (a head-dim sum and
    an rsqrt), layer scalar (one more rounding, a sum of length 1) and per-layer inputs (their
    projection and norm, then per layer the gate, product, projection and norm), an MoE
    layer's router softmax, top-k renormalisation and weighted sum of experts (the same
    experts chosen on both sides: a near tie in the router is a jump no bound covers, so the
    tests' routers are decisive), and the final logit soft-cap's tanh."""
    sums, stages = [], 0
    for spec in getattr(cfg, "layer_specs", ()):
        if spec.post_norms:
            sums += [cfg.hidden_size] * 2
            stages += 2
        if getattr(spec, "v_norm", False):
            sums.append(getattr(spec, "head_dim", None) or cfg.head_dim)
            stages += 1
        if getattr(spec, "layer_scalar", False):
            sums.append(1)
        moe = getattr(spec, "moe", None)
        if moe is not None:  # the router (hidden), its softmax (E terms, an exp), the top-k
            # renormalisation (k), the expert's down projection (its width), the weighted sum
            # of the k experts' outputs; a shared expert: its gate (hidden, a sigmoid's exp)
            sums += [cfg.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
                     moe.top_k + 1]
            stages += 1
            if moe.shared_intermediate_size:
                sums += [cfg.hidden_size, moe.shared_intermediate_size]
                stages += 1
        if getattr(cfg, "per_layer_input_size", 0):  # the gated per-layer input: gate, its
            sums += [cfg.hidden_size, cfg.per_layer_input_size, cfg.hidden_size]  # proj, norm
            stages += 2  # tanh, rsqrt
    if getattr(cfg, "per_layer_input_size", 0):  # the inputs' projection and its norm
        sums += [cfg.hidden_size, cfg.per_layer_input_size]
        stages += 1
        stages += ((spec.mlp_activation != "silu") + (spec.soft_cap is not None)
                   + 2 * bool(spec.qk_norm))
    stages += getattr(cfg, "final_soft_cap", None) is not None
    return reordered_chain_bound(sums) + (transcendental_bound(stages) if stages else 0.0)


def assert_close(got: object, want: object, *, atol: object = 0.0, rtol: float = 0.0,
                 err_msg: str = "") -> None:
    """|got - want| <= atol + rtol |want| elementwise, as np.testing.assert_allclose, but for
    an elementwise `atol` array too (the bounds here are per element; numpy formats atol into
    its message as a scalar). The failure names the worst element and its bound."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"shapes differ: {got.shape} vs {want.shape} {err_msg}")
    bound = np.broadcast_to(np.asarray(atol, np.float64) + rtol * np.abs(want), got.shape)
    err = np.abs(got - want)
    bad = ~(err <= bound)  # NaN on either side fails
    if bad.any():
        excess = np.where(bad, np.nan_to_num(err / np.maximum(bound, 1e-300), nan=np.inf), 0)
        i = np.unravel_index(int(np.argmax(excess)), got.shape)
        raise AssertionError(
            f"{int(bad.sum())} of {got.size} elements past their bound; worst at {i}: "
            f"got {got[i]!r}, want {want[i]!r}, |diff| {err[i]:.3e} > bound {bound[i]:.3e} "
            f"{err_msg}"[:2000])


# ------------------------------------------------------------------ whole models, from weights
def logit_magnitude_bound(final_norm: object, head: object, norm_offset: float = 0.0) -> float:
    """A priori bound, from the weights alone, on sum_i |h_i w_vi| for every logit v (so on
    every |logit| too): the final RMSNorm's output h_i = g_i x_i / sqrt(mean(x^2) + eps) has
    ||h||_2 <= sqrt(H) max|g| (eps only shrinks it), and Cauchy-Schwarz gives
    sum_i |h_i w_vi| <= ||h||_2 ||w_v||_2. `head` is the lm_head (or the tied embedding) as
    [V, H] or [H, V], H = len(final_norm); g = norm_offset + final_norm (Gemma stores the
    norm's scale as an offset from 1). Unlike max|ref| this is the magnitude Higham's bound
    asks for: it does not shrink where a logit's terms cancel."""
    g = np.abs(norm_offset + np.asarray(final_norm, np.float64)).reshape(-1)
    w = np.asarray(head, np.float64)
    norms = [np.sqrt((w ** 2).sum(axis)).max() for axis in (0, 1) if w.shape[axis] == len(g)]
    if not norms:
        raise ValueError(f"head {w.shape} has no axis of the hidden size {len(g)}")
    return float(np.sqrt(len(g)) * g.max() * max(norms))


def params_logit_bound(params: object, norm_offset: float = 0.0) -> float:
    """logit_magnitude_bound of a family's params' head (the lm_head, else the tied
    embedding): a plain array as it is; a quantized or packed one through its own matmul of
    the identity, the values it really multiplies by. `norm_offset`: the config's (Gemma's
    final norm scales by 1 + w)."""
    head = params.embed if params.lm_head is None else params.lm_head
    hidden = int(np.asarray(params.final_norm).shape[-1])
    if hasattr(head, "matmul"):
        head = head.matmul(np.eye(hidden, dtype=np.float32))
    return logit_magnitude_bound(params.final_norm, head, norm_offset)


def logits_atol(cfg: object, params: object, context_len: int) -> float:
    """max|logits - ref| bound for two float32 runs of the model `params` (of config `cfg`,
    over at most `context_len` positions) that differ in summation order (XLA against torch,
    SIMD widths, TP partial sums, blocked kernels) and in transcendental implementations:
    logits_rtol's relative error times the logits' a priori magnitude (params_logit_bound).
    First order: relative errors add along the chain; the last matmul turns the hidden
    state's relative error into at most that times sum_i |h_i w_vi|."""
    return logits_rtol(cfg, context_len) * params_logit_bound(
        params, getattr(cfg, "norm_offset", 0.0))


def gemma_logits_atol(cfg: object, params: object, context_len: int) -> float:
    """logits_atol for a Gemma-family model whose head may be stored quantized (a GGUF's
    Q8_0 embedding, which params_logit_bound does not read): logits_rtol, which already counts
    what a Gemma layer adds (`family_chain_extra`), plus the embedding scale's rounding; times
    the logits' a priori magnitude with the dequantized head and the final norm's real scale,
    1 + w (`norm_offset`), not its stored offset w."""
    H = cfg.hidden_size
    rtol = logits_rtol(cfg, context_len) + 2 * F32_UNIT_ROUNDOFF
    head = params.embed if params.lm_head is None else params.lm_head
    if hasattr(head, "matmul"):
        head = head.matmul(np.eye(H, dtype=np.float32))
    scale = np.asarray(params.final_norm, np.float64) + getattr(cfg, "norm_offset", 0.0)
    return rtol * logit_magnitude_bound(scale, head)


def model_logprob_atol(cfg: object, params: object, context_len: int) -> float:
    """|logprob - ref| bound for the same two runs: log p_k = z_k - logsumexp(z) moves by at
    most twice the logits' error (once in z_k, once through the logsumexp, whose gradient is
    a probability vector); the log-softmax's own arithmetic adds on each side the sum of V
    exponentials (gamma_V relative, which the log turns absolute), the exp and the log
    (transcendental_bound(2)), and the subtraction's rounding (u (|z_k| + |lse|) <= 2u Z).
    The 2**-20 covers the last rounding of values near 0."""
    z = params_logit_bound(params, getattr(cfg, "norm_offset", 0.0))
    own = 2 * gamma(cfg.vocab_size) + transcendental_bound(2) + 4 * F32_UNIT_ROUNDOFF * z
    return 2 * logits_atol(cfg, params, context_len) + own + 2.0 ** -20


def float32_wire_atol(max_abs: float) -> float:
    """What a float64 value loses on a float32 wire field (gRPC's float): one rounding, u
    relative, at most u * max_abs."""
    return F32_UNIT_ROUNDOFF * max_abs


# ------------------------------------------------------------------ storage formats, attention
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def unit_roundoff(dtype: object) -> float:
    """u of a float storage dtype given as a name, a numpy / jax dtype or a scalar type."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    return UNIT_ROUNDOFF[name]


def rounding_rtol(dtype: object, roundings: int = 2) -> float:
    """rtol for values that agree in float32 but are each rounded to `dtype` at the end
    (`roundings` = 2: both sides, 1: one side, the other exact): |fl(a) - a| <= u |a| per
    rounding, and |a| <= |fl(a)| / (1 - u) turns that into a bound relative to the
    rounded value assert_allclose divides by."""
    u = unit_roundoff(dtype)
    return roundings * u / (1 - u)


def matmul_atol(x: np.ndarray, w: np.ndarray, *, sides: int = 1, roundings: int = 0,
                operand_dtype: object = "float32") -> np.ndarray:
    """Elementwise bound on the float32 error of x [..., K] @ w [K, N]: each of `sides`
    evaluations (1: against an exact oracle, 2: two orders) errs by at most
    gamma_{K + roundings} * (|x| @ |w|) (Higham 3.5: K - 1 additions, one product, and
    `roundings` more on each term, e.g. a weight dequantized as q * s (+ z)); a weight rounded
    to operand_dtype for one side adds u_o * (|x| @ |w|)."""
    k = x.shape[-1]
    mag = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
    bound = sides * gamma(k + roundings) * mag
    if unit_roundoff(operand_dtype) > F32_UNIT_ROUNDOFF:
        bound = bound + unit_roundoff(operand_dtype) * mag
    return bound


def attention_atol(batch, *, sm_scale: float, sliding_window: int | None = None,
                   soft_cap: float | None = None, head_dim: int | None = None,
                   sides: int = 2, p_dtype: object = "float32",
                   operand_dtype: object = "float32", slack: float = 1.0) -> np.ndarray:
    """Elementwise absolute bound [live tokens, Hq, D] on the float32 error of ragged
    attention over `batch` (kernel_cases.RaggedBatch: specs, seq_q / seq_k / seq_v), for
    `sides` = 2 implementations that differ in their order of operations (any blocking, SIMD
    width, online-softmax schedule or split-KV merge), or `sides` = 1 against an exact oracle.

    Per output o = N / Z, N = sum_j w_j v_j, Z = sum_j w_j, w_j = exp(s_j - m), over the n
    keys a row may see, with S = max_j sm_scale * sum_d |q_d k_jd| (Higham's magnitude of the
    score sums) and M = sum_j p_j |v_j| (that of the output sum), to first order:
      a score s_j errs by (gamma_D + 2u) S (the dot; sm_scale applied to q or to s), the soft
      cap adds (2 + 2 ulps) u S (tanh' <= 1 passes the rest through), s_j - m adds 2u S
      (|s_j - m| <= 2S), exp 2 ulps u: eps, each weight's relative error;
      N and Z: at most n additions plus n online rescales each, gamma_{2n+1} relative (the
      rescale factor's own exp error multiplies N and Z alike and cancels in N / Z);
      |dN / Z| <= (eps + gamma_{2n+1}) M, |o dZ / Z| <= |o| (eps + gamma_{2n+1}), |o| <= M,
      and the division 2u: |do| <= (2 eps + 2 gamma_{2n+1} + 2u) M per side.
    Roundings of one side (the kernel) add to it: p rounded to p_dtype before p @ V, 2u_p M
    (u_p on each weight, once more if Z sums the rounded weights); q, K and V rounded to
    operand_dtype for the matmuls, 2u_o S on each score (2 eps-like terms) and u_o M. Output
    rounding to a 16-bit dtype is relative: rounding_rtol. `slack` scales S and M where the
    batch's float arrays only approximate what the kernels read (dequantized 8-bit pages).

    Size: float32, D 64, a few hundred keys, sides 2: 1e-4 - 1e-3; 4k keys: ~1.7e-3. A wrong
    head, a missed or a foreign page moves outputs by a large fraction of M (~0.8): measured
    10-20x past this bound at 4k keys (one 16-key page of 4096 duplicated), 1000x at 300."""
    u = F32_UNIT_ROUNDOFF
    u_p, u_o = unit_roundoff(p_dtype), unit_roundoff(operand_dtype)
    exp_err = 2 * TRANSCENDENTAL_ULPS * u
    out = []
    for (ctx, n), q, k, v in zip(batch.specs, batch.seq_q, batch.seq_k, batch.seq_v):
        d = head_dim or q.shape[2]
        if n == 0:  # a live sequence with no query rows this step: no outputs to bound
            out.append(np.zeros((0, q.shape[1], d)))
            continue
        q = q[..., :d].astype(np.float64)
        group = q.shape[1] // k.shape[1]
        k = np.repeat(k[..., :d].astype(np.float64), group, axis=1)
        v = np.repeat(v[..., :d].astype(np.float64), group, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) * sm_scale
        mag = np.einsum("qhd,khd->hqk", np.abs(q), np.abs(k)) * sm_scale * slack
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        qpos = ctx + np.arange(n)[:, None]
        kpos = np.arange(ctx + n)[None, :]
        allowed = kpos <= qpos
        if sliding_window is not None:
            allowed &= kpos > qpos - sliding_window
        s = np.where(allowed[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        big_m = np.einsum("hqk,khd->qhd", p, np.abs(v)) * slack             # [n, Hq, D]
        big_s = np.where(allowed[None], mag, 0.0).max(-1).T[:, :, None]      # [n, Hq, 1]
        keys = allowed.sum(-1)                                               # [n]
        g = np.array([gamma(2 * int(m) + 1) for m in keys])[:, None, None]
        eps = (gamma(d) + 4 * u) * big_s + exp_err
        if soft_cap is not None:
            eps = eps + (2 + 2 * TRANSCENDENTAL_ULPS) * u * big_s
        bound = sides * (2 * eps + 2 * g + 2 * u) * big_m
        if u_p > u:
            bound = bound + 2 * u_p * big_m
        if u_o > u:
            bound = bound + (4 * u_o * big_s + u_o) * big_m
        out.append(bound)
    return np.concatenate(out) if out else np.zeros((0, 1, 1))


def kernel_attention_tolerance(impl: str, batch, q_dtype: object, *, interpret: bool = True,
                               roundings: int = 2, **opts) -> dict:
    """assert_allclose's {"atol", "rtol"} for attention `impl` against the jnp reference on
    the same pages (`opts`: sm_scale, sliding_window, soft_cap, head_dim, slack), from what
    each implementation rounds besides its float32 arithmetic (attention_atol):
      cpu: nothing (float32 throughout);
      pallas_tpu: p to q's dtype before p @ V; compiled, float32 dots at the MXU's default
        precision (one bfloat16 pass: q, K, V and p rounded to bfloat16);
      pallas_gpu: q, K, V and p in the MMA dtype, q's if 16-bit, else bfloat16 (WGMMA).
    The output's rounding to a 16-bit q dtype is rounding_rtol(q_dtype, roundings): 2 when
    the reference's output is rounded too, 1 when it stays float32."""
    q_name = q_dtype if isinstance(q_dtype, str) else np.dtype(q_dtype).name
    wide = q_name == "float32"
    if impl == "cpu":
        p_dtype = operand = "float32"
    elif impl == "pallas_tpu":
        p_dtype = operand = q_name if interpret or not wide else "bfloat16"
    elif impl == "pallas_gpu":
        p_dtype = operand = "bfloat16" if wide else q_name
    else:
        raise ValueError(impl)
    return {"atol": attention_atol(batch, p_dtype=p_dtype, operand_dtype=operand, **opts),
            "rtol": 0.0 if wide else rounding_rtol(q_name, roundings)}
