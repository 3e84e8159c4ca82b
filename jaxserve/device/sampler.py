"""Sampling on device: a pure function of (logits, per-row sampling arrays) -> tokens, logprobs.

Data flow inside the compiled step: f32[S, V] logits of the rows that sample ->
`apply_grammar_mask` (the constrained rows' disallowed tokens set to -inf, unpacked from the
i32[S, ceil(V / 32)] bitmask, which the host fills from a row's grammar and / or its
allowed_token_ids / bad_words, `engine.token_filter`; the rest of the sampler runs in one of
two lax.cond branches, masked or not, so a step without a mask pays nothing and needs no
other executable) ->
`apply_logit_bias` (each row's sparse (token id, bias) entries added; padding entries carry
an out-of-range id that the scatter drops) -> `apply_penalties` (repetition / presence /
frequency, from each row's token history) -> `filter_logits` (temperature, then top-k, top-p
and min-p as -inf masks, found without a sort of the vocabulary: `jaxserve.device.nucleus`)
-> an inverse-CDF draw from one uniform per row, keyed by the request (its seed folded with
its output length, so a seeded request draws the same tokens whatever shares its batch)
-> greedy rows take the argmax of the biased, penalised logits instead. Logprobs are of the
raw model distribution (log_softmax of the unprocessed logits, as vLLM reports them): the
sampled token's and the top `MAX_LOGPROBS`; with a grammar too (the model's view of the
token, not the constrained distribution's, in which every allowed token's mass grows).

On CPU a batch of more than 8 rows runs this 8 rows at a time (`sample_blocks`, a lax.map):
XLA:CPU's scratch for the whole call grew past glibc's 32 MiB mmap threshold at 64 rows (36
MiB with penalties), which cost a fresh mapping and its page faults on every step.

Every knob is a per-row array, so a new value never recompiles. What a step may not need is
static, like its bucket: whether penalties are applied (`apply_penalty`; the history array is
only sent when a row needs it), and the logit bias width B: 0 when no row has a bias (no
scatter traced, no second copy of the logits written: the argmax reads the model's logits
directly), else `sampling_params.MAX_LOGIT_BIAS` (see `engine.batch_parts.LogitBiasRows`).
With a bias the scatter-add writes a biased copy of f32[S, V], as the logprobs still read the
raw logits. The inputs are the engine's batch parts themselves (`SamplingTensors`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.device import nucleus
from jaxserve.engine.batch_mask import TokenMaskRows
from jaxserve.engine.batch_parts import LogitBiasRows, PenaltyRows, SamplingRows
from jaxserve.engine.sampling_params import DEVICE_COLUMN, MAX_LOGPROBS, PAD_ROW
from jaxserve.models.blocks import log_softmax


# The engine's per-feature batch parts (`engine/batch_parts.py`, `engine/batch_mask.py`) are
# the sampler's inputs as they are: on the device the same classes hold jax arrays.
for _part in (SamplingRows, PenaltyRows, LogitBiasRows, TokenMaskRows):
    jax.tree_util.register_dataclass(_part)


@struct.dataclass
class SamplingTensors:
    """Per-row sampling inputs, one part per feature as in the engine's `StepBatch`; S is the
    step's sequence bucket (each part's arrays and shapes are described with its class)."""

    sampling: SamplingRows  # knobs f32[S, K] (sampling_params.DEVICE_FIELDS), rng_key u32[S, 2]
    #                         raw threefry key data, already folded with the draw number
    penalties: PenaltyRows  # history i32[S, P] -1 padded, history_is_output bool[S, P]
    #                         (P = 0: no penalties)
    bias: LogitBiasRows  # ids i32[S, B] (padded with an id >= V: dropped), values f32[S, B]
    #                      (B = 0: no row has a bias)
    mask: TokenMaskRows  # bitmask i32[S, W] W = ceil(V / 32): bit t % 32 of word t // 32 set =
    #                      token t allowed, in the rows where constrained bool[S] is set (W = 0:
    #                      no mask traced; the runner always sends the full width)

    def knob(self, name: str) -> jax.Array:
        """f32[S]: the column of sampling field `name` (resolved at trace time). A column's
        padding value (`Column.pad` in sampling_params) turns its knob off; top_k <= 0 is the
        whole vocabulary, logprobs >= 0 asks for logprobs."""
        return self.sampling.knobs[:, DEVICE_COLUMN[name]]

    @classmethod
    def of(cls, rng_key: jax.Array, history: jax.Array, history_is_output: jax.Array,
           bias_ids: jax.Array | None = None, bias_values: jax.Array | None = None,
           bitmask: jax.Array | None = None, constrained: jax.Array | None = None,
           **columns: jax.Array) -> "SamplingTensors":
        """From named f32[S] columns; a column not given is the padding value (off), no bias
        arrays mean no bias (width 0), no bitmask no grammar (width 0: no mask traced)."""
        S = rng_key.shape[0]
        if bias_ids is None:
            bias_ids, bias_values = jnp.zeros((S, 0), jnp.int32), jnp.zeros((S, 0), jnp.float32)
        if bitmask is None:
            bitmask = jnp.zeros((S, 0), jnp.int32)
            constrained = jnp.zeros((S,), bool)
        knobs = jnp.stack([jnp.asarray(columns.pop(name), jnp.float32) if name in columns
                           else jnp.full((S,), pad, jnp.float32)
                           for name, pad in zip(DEVICE_COLUMN, PAD_ROW)], axis=1)
        if columns:
            raise TypeError(f"unknown sampling columns {sorted(columns)}")
        return cls(SamplingRows(knobs, rng_key), PenaltyRows(history, history_is_output),
                   LogitBiasRows(bias_ids, bias_values), TokenMaskRows(bitmask, constrained))

    def with_mask(self, bitmask: jax.Array, constrained: jax.Array | None = None
                  ) -> "SamplingTensors":
        """These tensors with another grammar mask (and constrained rows, if given)."""
        return self.replace(mask=TokenMaskRows(
            bitmask, self.mask.constrained if constrained is None else constrained))


@struct.dataclass
class SampleOutput:
    tokens: jax.Array  # i32[S]
    logprob: jax.Array  # f32[S] logprob of the sampled token
    top_ids: jax.Array  # i32[S, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[S, MAX_LOGPROBS]


def allowed_bits(words: jax.Array, constrained: jax.Array) -> jax.Array:
    """bool[S, K, 32]: token 32 * k + j allowed by the packed mask words i32[S, K] (bit j), or
    by no grammar at all (rows not `constrained`)."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    return (((words[:, :, None] >> shifts) & 1) != 0) | ~constrained[:, None, None]


def apply_grammar_mask(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """-inf for every token a constrained row's bitmask does not allow (unconstrained rows
    unchanged)."""
    S, V = logits.shape
    allowed = allowed_bits(st.mask.bitmask, st.mask.constrained).reshape(S, -1)[:, :V]
    return jnp.where(allowed, logits, -jnp.inf)


def _as_words(logits: jax.Array) -> jax.Array:
    """f32[S, W, 32]: the logits as 32-token words, the last padded with -inf (no copy when
    32 divides the vocabulary, as it does for the usual ones)."""
    S, V = logits.shape
    W = -(-V // 32)
    if V != W * 32:
        logits = jnp.pad(logits, ((0, 0), (0, W * 32 - V)), constant_values=-jnp.inf)
    return logits.reshape(S, W, 32)


def _masked_word_max(words: jax.Array, st: SamplingTensors) -> jax.Array:
    return jnp.where(allowed_bits(st.mask.bitmask, st.mask.constrained), words, -jnp.inf).max(-1)


def _masked_word_max_rows(words: jax.Array, st: SamplingTensors) -> jax.Array:
    """`_masked_word_max` 16 rows at a time: XLA:CPU writes the masked words out before its
    reduction, and at 256 rows of a 49k vocabulary that 50 MB pass cost 45 ms against 11 ms
    in cache-sized pieces (a scratch timing of this reduction alone; the whole masked
    sampler: `scripts/bench/bench_sampler.py`)."""
    S, W, _ = words.shape
    if S <= ROW_CHUNK or S % ROW_CHUNK:
        return _masked_word_max(words, st)
    n = S // ROW_CHUNK
    parts = (words.reshape(n, ROW_CHUNK, W, 32), st.mask.bitmask.reshape(n, ROW_CHUNK, W),
             st.mask.constrained.reshape(n, ROW_CHUNK))
    return jax.lax.map(lambda p: jnp.where(allowed_bits(p[1], p[2]), p[0], -jnp.inf).max(-1),
                       parts).reshape(S, W)


ROW_CHUNK = 16


def greedy_tokens(logits: jax.Array, st: SamplingTensors, masked: bool) -> jax.Array:
    """i32[S]: each row's argmax (the first index of its maximum, as jnp.argmax), among the
    tokens its grammar allows when `masked` (static). Two levels over 32-token words: the
    maximum of each word (a vectorised reduction, into which the mask's bits fold), the first
    best word, then the first best token inside it. XLA:CPU's argmax is a scalar loop: 2.1 ->
    1.3 ms at 32 rows of a 49k vocabulary, 15.6 -> 5.5 ms at 256, and a fused mask made its
    loop 3x slower still (scratch timings of the argmax alone)."""
    words = _as_words(logits)
    if masked:
        word_max = jax.lax.platform_dependent(words, st, cpu=_masked_word_max_rows,
                                              default=_masked_word_max)
    else:
        word_max = words.max(-1)
    best = jnp.argmax(word_max, axis=-1)  # i32[S]
    inner = jnp.take_along_axis(words, best[:, None, None], axis=1)[:, 0, :]  # f32[S, 32]
    if masked:
        bits = jnp.take_along_axis(st.mask.bitmask, best[:, None], axis=1)
        inner = jnp.where(allowed_bits(bits, st.mask.constrained)[:, 0, :], inner, -jnp.inf)
    return (best * 32 + jnp.argmax(inner, axis=-1)).astype(jnp.int32)


def apply_logit_bias(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """logits[r, bias.ids[r, j]] += bias.values[r, j]: a scatter-add of S x B entries (ids
    within a row are distinct). Ids outside [0, V) (the padding) are dropped, not clamped or
    wrapped, so padding does no work; B = 0 is no op at all (nothing traced)."""
    if st.bias.ids.shape[1] == 0:
        return logits
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, st.bias.ids].add(st.bias.values.astype(logits.dtype), mode="drop")


def apply_penalties(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """vLLM/HF semantics: repetition over prompt+output; presence/frequency over output.

    Token t of row r, seen anywhere in its history (i32[S, P], -1 padded), becomes
    `(l / rep if l > 0 else l * rep) - frequency * count - presence * (count > 0)`, count the
    number of its *output* entries; the division is the product with the row's reciprocal,
    written so here because it is what XLA runs anyway (its simplifier turns a division by a
    broadcast into that product), and a test can then hold the result to a numpy oracle bit
    for bit. Rows whose knobs are their padding values (1, 0, 0) come out unchanged.

    Data flow: the history scattered into bool[S, V] `seen` and f32[S, V] output counts, then
    one elementwise expression that XLA fuses into each of its readers. On XLA:CPU the cost is
    memory, not arithmetic (~1 ms at 32 rows of a 49k vocabulary): the two scratch arrays
    (7.5 MiB there) stay live through the draw, which takes the sampler's temp buffer from 30
    to 36 MiB, and glibc maps an allocation over 32 MiB afresh on each call, so its pages are
    faulted in again every step (~4,600 faults: most of the ~4 ms the penalties add in
    `scripts/bench/bench_sampler.py`; under jemalloc with its decay off they add 0.8 ms, and
    the engine step at 32 rows is 1.08x a greedy one, not 1.20x). Any exact form keeps one
    f32[S, V] live there (the raw logits must survive for the logprobs). Gathering the logits
    at the history ids and scattering the penalised values back, with the counts from a sort
    of each row's history (or an [S, P, P] compare), was measured too: no faster at P = 384,
    and at P = 4096 (the history is max_model_len wide) the sampler call 2.3x slower, so this
    form stays.
    """
    S, V = logits.shape
    if st.penalties.history.shape[1] == 0:
        return logits
    rows = jnp.arange(S)[:, None]
    valid = st.penalties.history >= 0
    ids = jnp.where(valid, st.penalties.history, 0)  # i32[S, P]
    seen = jnp.zeros((S, V), bool).at[rows, ids].max(valid)  # bool[S, V]
    out_counts = jnp.zeros((S, V), jnp.float32).at[rows, ids].add(
        (valid & st.penalties.history_is_output).astype(jnp.float32))  # f32[S, V]
    rep = st.knob("repetition_penalty")[:, None]  # f32[S, 1]
    inv_rep = 1 / rep
    # `seen`'s select stands between each product and the subtraction after it: without
    # one (the gathered form) XLA:CPU contracted them into an FMA, one rounding fewer.
    logits = jnp.where(seen, jnp.where(logits > 0, logits * inv_rep, logits * rep), logits)
    logits = logits - st.knob("frequency_penalty")[:, None] * out_counts
    return logits - st.knob("presence_penalty")[:, None] * (out_counts > 0)


def filter_logits(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p set to -inf,
    found without sorting the vocabulary (`nucleus.filter_logits`: the semantics, and why).

    Ties at the top-k / top-p boundary are kept (a value equal to the cut-off stays), so the
    result does not depend on an order among equal logits.
    """
    return nucleus.filter_logits(logits, st.knob("temperature"), st.knob("top_k"),
                                 st.knob("top_p"), st.knob("min_p"))


def sample(logits: jax.Array, st: SamplingTensors, apply_penalty: bool,
           invariant: bool = False) -> SampleOutput:
    """Draw one token per row. logits: f32[S, V]. `apply_penalty` is static, as `invariant`
    (batch-invariant mode: logprobs by `blocks.log_softmax`'s fixed-order sum).

    Work no row asked for is skipped at run time (lax.cond): no random draw when every row
    is greedy, no logprob top-k when no row wants logprobs. On CPU, more than SAMPLE_BLOCK
    rows run SAMPLE_BLOCK at a time (`sample_blocks`); elsewhere all at once.
    """
    S = logits.shape[0]
    block = next((b for b in (SAMPLE_BLOCK, SAMPLE_BLOCK // 2) if S % b == 0), None)
    if block is None or S <= SAMPLE_BLOCK:
        return sample_rows(logits, st, apply_penalty, invariant)
    return jax.lax.platform_dependent(
        logits, st, cpu=lambda x, st: sample_blocks(x, st, apply_penalty, block, invariant),
        default=lambda x, st: sample_rows(x, st, apply_penalty, invariant))


# Rows per block of the CPU sampler. Every step of the sampler is row by row, but XLA:CPU
# holds the whole call's scratch in one temp buffer that grows with the rows (temperature +
# top_p at a 49k vocabulary: 12 MiB at 32 rows, 24 at 64, 36 at 64 with penalties), and
# glibc serves an allocation over 32 MiB by a fresh mmap on every call, so each step faulted
# all its pages in again (~4,600 faults a call at 36 MiB, seen with strace; under jemalloc
# the same call was 2-4x faster). A loop over blocks of 8 rows keeps the buffer at one
# block's scratch (5-6 MiB, in cache) whatever the batch: 64 rows with penalties 13.9 ms
# against 20.7 all at once, 32 rows within noise of all at once (interleaved runs on the
# 2-core host; blocks of 16: 17.3 ms).
SAMPLE_BLOCK = 8


def sample_blocks(logits: jax.Array, st: SamplingTensors, apply_penalty: bool,
                  block: int, invariant: bool = False) -> SampleOutput:
    """`sample_rows` over blocks of `block` rows (S a multiple of it), one after another
    (lax.map: one loop body, so one block's scratch)."""
    S = logits.shape[0]
    n = S // block

    def split(a: jax.Array) -> jax.Array:
        return a.reshape(n, block, *a.shape[1:])

    out = jax.lax.map(lambda args: sample_rows(args[0], args[1], apply_penalty, invariant),
                      (split(logits), jax.tree.map(split, st)))
    return jax.tree.map(lambda a: a.reshape(S, *a.shape[2:]), out)


def sample_rows(logits: jax.Array, st: SamplingTensors, apply_penalty: bool,
                invariant: bool = False) -> SampleOutput:
    """`sample` on all S rows at once."""
    raw = logits
    sampling = st.knob("temperature") > 0

    def pick(logits: jax.Array, masked: bool) -> jax.Array:
        logits = apply_logit_bias(logits, st)
        if apply_penalty:
            logits = apply_penalties(logits, st)
        greedy = greedy_tokens(logits, st, masked)  # the mask is -inf: bias and penalties
        # leave it -inf, so applying it after them is applying it first

        def draw(_: None) -> jax.Array:
            x = apply_grammar_mask(logits, st) if masked else logits
            return nucleus.inverse_cdf_draw(filter_logits(x, st), st.sampling.rng_key)

        drawn = jax.lax.cond(jnp.any(sampling), draw, lambda _: greedy, None)
        return jnp.where(sampling, drawn, greedy)

    # Masked or not, the whole rest of the sampler is one of two lax.cond branches: a branch
    # that only masked (or not) would hand the rest a copy of f32[S, V], and a step without
    # a grammar runs exactly the unmasked sampler.
    tokens = pick(logits, False) if st.mask.bitmask.shape[1] == 0 else jax.lax.cond(
        jnp.any(st.mask.constrained), lambda x: pick(x, True), lambda x: pick(x, False), logits)

    def logprobs(_: None) -> tuple[jax.Array, jax.Array, jax.Array]:
        lp = log_softmax(raw, invariant)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
        return chosen, top_ids.astype(jnp.int32), top_lp

    def no_logprobs(_: None) -> tuple[jax.Array, jax.Array, jax.Array]:
        S = raw.shape[0]
        return (jnp.zeros((S,), jnp.float32), jnp.zeros((S, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((S, MAX_LOGPROBS), jnp.float32))

    wants_logprobs = st.knob("logprobs") >= 0  # bool[S]
    chosen, top_ids, top_lp = jax.lax.cond(jnp.any(wants_logprobs), logprobs, no_logprobs, None)
    return SampleOutput(tokens=tokens, logprob=chosen, top_ids=top_ids, top_logprobs=top_lp)
