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
