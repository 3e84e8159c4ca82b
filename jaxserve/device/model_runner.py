"""The host/device boundary: owns params and KV pages on device, runs one compiled step.

Data flow: StepBatch (numpy, from `batch.py`, one part per feature) -> `to_step_inputs` (the
parts as device pytrees) -> one `jax.device_put` of the whole tree -> `forward_step`
(module-level, jitted once per (tokens, seqs) bucket, KV pages donated so XLA updates them
in place; fed tokens taken from the previous step's sampled tokens, still on device) -> logits
f32[S, V] stay on device -> `sample_step` (jitted
once per seqs bucket, penalties on/off and logit bias width 0 / on; also the sampled tokens
padded to `max_num_seqs`, the next step's feed; a step without a grammar bitmask gets a
device-resident one of its bucket, never sent, so masked and unmasked steps share one
executable) -> `dispatch` returns with all of it queued
-> `collect`: one `jax.device_get` of the sampled ids and logprobs -> StepResult (numpy).
On a step that scores prompt tokens, `prompt_logprobs` (jitted once per token bucket) also runs on the
forward's hidden states and its rows come back with the same `device_get`. Nothing else in
the engine touches jax arrays. The sampler is its own executable so that its penalties and
bias variants multiply only the (cheap) sampler compiles, not the model's.

Failures (`runner.RunnerFailed`): `execute` reports a failure as not fatal when the device
state is intact, i.e. nothing reached the device (the batch could not be converted or placed)
or the failure came before the donated KV buffer was consumed (a trace-time error), and the
KV buffer is alive; as fatal when the KV buffer was consumed by the failed step (donation
deletes it) or on any JAX runtime error (device / XLA failure: the device state is unknown).

`warmup()` compiles every bucket up front (with a progress bar); `arm()` then arms the compile
guard, and any further compile is counted (and is a bug).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from jaxserve.device.compile_guard import CompileGuard
from jaxserve.device.lora_slots import DeviceLoraSlots
from jaxserve.device.prompt_logprobs import (PromptLogprobsInputs, PromptLogprobsOutput,
                                           prompt_logprobs)
from jaxserve.device.sampler import SampleOutput, SamplingTensors, sample
from jaxserve.engine.batch import BatchShape, StepBatch, bitmask_words, empty_batch
from jaxserve.engine.runner import LateMask, RunnerFailed, StepResult
from jaxserve.engine.sampling_params import MAX_LOGPROBS
from jaxserve.kernels_pallas import AttentionMetadata, KVPages, is_quantized_dtype
from jaxserve.models import placement
from jaxserve.models.config import ModelConfig
from jaxserve.models.blocks import lm_logits
from jaxserve.models.families import ModelParams
from jaxserve.models.lora import LoraStacks, attach
from jaxserve.models.paged import init_kv_cache, paged_hidden

log = logging.getLogger(__name__)


@struct.dataclass
class StepInputs:
    token_ids: jax.Array  # i32[T]
    feed_rows: jax.Array  # i32[T] -1, or the row of the previous step's token this one is
    positions: jax.Array  # i32[T]
    md: AttentionMetadata
    logits_indices: jax.Array  # i32[S]
    lora_slots: jax.Array | None = None  # i32[T] each token's adapter slot (0: none); None
    #                                     without LoRA (the step then has no LoRA at all)


def forward_step(params: ModelParams, kv_pages: KVPages, inputs: StepInputs, feed: jax.Array,
                 cfg: ModelConfig, attn_impl: str, mesh: Mesh | None = None,
                 expert_parallel: bool = False, aux_layers: tuple[int, ...] = (),
                 lora: LoraStacks | None = None
                 ) -> tuple[KVPages, jax.Array, jax.Array, jax.Array | None]:
    """`feed` i32[max_num_seqs]: the previous step's sampled tokens. `kv_pages`: the float
    pages, or a QuantizedKV (pages and scales, both donated). -> (updated kv_pages,
    f32[S, vocab] logits of each sequence's sampling position, [T, hidden] every token's last
    hidden state, for the prompt logprobs pass, and with `aux_layers` (an EAGLE-3 head's,
    `paged.paged_hidden`) every token's auxiliary hidden states [T, n * hidden], else None).
    `lora`: the adapter slots' stacks (`device.lora_slots`), each token's projections adding
    its slot's delta (`inputs.lora_slots`); None: no LoRA in the step."""
    if lora is not None:
        if inputs.lora_slots is None:
            raise ValueError("forward_step: lora stacks given without inputs.lora_slots")
        params = params.replace(layers=attach(params.layers, lora, inputs.lora_slots, cfg,
                                              mesh))
    fed = feed[jnp.maximum(inputs.feed_rows, 0)]
    token_ids = jnp.where(inputs.feed_rows >= 0, fed, inputs.token_ids)
    out = paged_hidden(params, kv_pages, token_ids, inputs.positions, inputs.md, cfg,
                       attn_impl, mesh, expert_parallel, aux_layers=aux_layers)
    hidden, kv_pages = out[0], out[1]
    aux = out[2] if aux_layers else None  # type: ignore[misc]
    if aux is not None and mesh is not None:  # the head runs replicated: one known layout
        aux = jax.lax.with_sharding_constraint(aux, placement.replicated(mesh))
    return kv_pages, lm_logits(cfg, params, hidden[inputs.logits_indices]), hidden, aux


def sample_step(logits: jax.Array, st: SamplingTensors, apply_penalty: bool, feed_len: int,
                invariant: bool = False) -> tuple[SampleOutput, jax.Array]:
    """The sampler, plus its tokens zero-padded to i32[feed_len]: the next step's `feed`, one
    shape whatever this step's bucket (so the forward never recompiles for it)."""
    out = sample(logits, st, apply_penalty=apply_penalty, invariant=invariant)
    return out, jnp.pad(out.tokens, (0, feed_len - out.tokens.shape[0]))  # a pad, no scatter


# The jitted step functions the runner compiles and runs, one executable per bucket /
# variant; public so that the export tests and the benchmarks (scripts/bench/bench_sampler.py,
# ...) lower and time exactly what the engine runs.
forward_jit = jax.jit(forward_step,
                      static_argnames=("cfg", "attn_impl", "mesh", "expert_parallel",
                                       "aux_layers"),
                      donate_argnames=("kv_pages",))
sample_jit = jax.jit(sample_step, static_argnames=("apply_penalty", "feed_len", "invariant"))
prompt_logprobs_jit = jax.jit(prompt_logprobs, static_argnames=("cfg", "invariant"))


StepTree = tuple[StepInputs, SamplingTensors, PromptLogprobsInputs | None]


def to_step_inputs(b: StepBatch, lora: bool = False) -> StepTree:
    """The batch's parts as the device pytrees: the forward's inputs, the sampler's (kept
    apart so the penalties history, which only the sampler reads, never changes the forward's
    input shapes) and, on a step that scores prompt tokens, the prompt logprobs pass's.
    `lora`: the step reads adapter slots (the forward then takes the tokens' slots)."""
    f = b.forward
    md = AttentionMetadata(slot_mapping=f.slot_mapping, block_tables=f.block_tables,
                           kv_lens=f.kv_lens, cu_q_lens=f.cu_q_lens, num_seqs=f.num_seqs)
    # The sampler reads the engine's parts as they are (a None bitmask: `_place` adds one).
    st = SamplingTensors(b.sampling, b.penalties, b.bias, b.mask)
    lp = b.prompt_logprobs
    plp = PromptLogprobsInputs(indices=lp.indices, targets=lp.targets, num=lp.num) \
        if lp.present else None
    return StepInputs(token_ids=f.token_ids, feed_rows=f.feed_rows, positions=f.positions,
                      md=md, logits_indices=f.logits_indices,
                      lora_slots=b.lora.token_slots if lora else None), st, plp


def place_inputs(tree: Any, sharding: NamedSharding | None) -> Any:
    """The step's numpy inputs (any pytree of arrays: a drafter's params and rounds too) on
    device (replicated over the mesh when there is one).

    Over several processes each process builds its own copies from its (identical) numpy
    arrays: `jax.device_put` would first compare every leaf across processes, one blocking
    cross-host round trip per array per step.
    """
    if sharding is None or sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_callback(
        x.shape, sharding, lambda index: x[index]), tree)


def compile_buckets(runner: "ModelRunner", execute: Callable[[StepBatch], object],
                    progress: bool) -> None:
    """Hand an all-padding batch of every bucket of `runner` to `execute`: the runner's
    `compile_step` (compiles without running), or a step that first announces itself to the
    other processes and runs."""
    for t, s, p, b, lp in tqdm(runner.buckets(), desc="compiling step buckets",
                               disable=not progress, unit="bucket"):
        execute(empty_batch(runner.shape, t, s, p, b, lp))
    jax.block_until_ready(runner.kv_pages)


@dataclasses.dataclass
class ModelPending:
    """A dispatched step: its device outputs (not yet copied to the host)."""

    out: SampleOutput
    scored: PromptLogprobsOutput | None
    aux: jax.Array | None = None  # f[T, n * hidden] the step's auxiliary hidden states (an
    #                               EAGLE-3 head's input, `aux_layers`), left on the device


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, params: ModelParams, shape: BatchShape,
                 num_pages: int, kv_dtype: jnp.dtype, attn_impl: str = "reference",
                 kv_head_dim: int | None = None, mesh: Mesh | None = None,
                 expert_parallel: bool = False, aux_layers: tuple[int, ...] = (),
                 batch_invariant: bool = False, lora: DeviceLoraSlots | None = None):
        """`mesh`: tensor parallel over its "model" axis; `model_cfg` and `params` are then
        the sharded model's (`placement.tp_model_config`, `placement.place_params`);
        `expert_parallel`: the params' experts are split whole over that axis
        (`place_params(..., expert_parallel=True)`) and the step runs them so;
        `aux_layers`: each step also keeps these layers' inputs on the device
        (`ModelPending.aux`, what an EAGLE-3 head reads; `paged.paged_hidden`);
        `batch_invariant`: logprobs (sampled and prompt) by a fixed-order sum;
        `lora`: the adapter slots every step reads (`load_lora` fills them)."""
        if MAX_LOGPROBS > model_cfg.vocab_size:
            raise ValueError(f"vocab_size={model_cfg.vocab_size} < MAX_LOGPROBS={MAX_LOGPROBS}")
        self.model_cfg = model_cfg
        self.params = params
        self.shape = shape
        self.attn_impl = attn_impl
        self.mesh = mesh
        self.expert_parallel = expert_parallel
        self.aux_layers = aux_layers
        self.invariant = batch_invariant
        self.lora = lora
        def zeros() -> KVPages:  # int8 / fp8: a QuantizedKV (pages + scales)
            return init_kv_cache(model_cfg, num_pages, shape.page_size, kv_dtype, kv_head_dim)

        if mesh is None:
            self.kv_pages: KVPages = zeros()
            self.inputs_sharding = None
        else:
            # Created sharded: no device ever holds the whole KV array (nor its scales).
            self.kv_pages = jax.jit(zeros, out_shardings=placement.kv_sharding(
                mesh, is_quantized_dtype(kv_dtype)))()
            self.inputs_sharding = placement.replicated(mesh)
        # The last dispatched step's sampled tokens, i32[max_num_seqs] (one shape for every
        # bucket), which the next step's fed rows read; placed like the step's inputs.
        self.feed_len = max(s for _, s in shape.buckets)
        self._feed = jax.device_put(np.zeros(self.feed_len, np.int32), self.inputs_sharding)
        self.guard = CompileGuard()
        self._no_mask: dict[int, jax.Array] = {}  # seqs bucket -> i32[S, W] unused bitmask

    @property
    def compiles_after_warmup(self) -> int:
        return self.guard.compiles_after_warmup

    def buckets(self) -> list[tuple[int, int, bool, bool, bool]]:
        """(tokens, seqs, penalties, bias, prompt logprobs) shapes that warmup runs: every
        forward bucket plain; the other sampler variants (penalties, logit bias, both) once
        per distinct seqs bucket, each with that bucket's smallest (cheapest) forward, which
        is already compiled: the variants add sampler compiles only; and the prompt logprobs
        pass once per distinct tokens bucket (with one of its forwards)."""
        plain = [(t, s, False, False, False) for t, s in self.shape.buckets]
        smallest_t = {s: t for t, s in reversed(self.shape.buckets)}
        some_s = {t: s for t, s in reversed(self.shape.buckets)}
        return plain + [(smallest_t[s], s, p, b, False) for s in sorted(smallest_t)
                        for p, b in ((True, False), (False, True), (True, True))] + \
            [(t, some_s[t], False, False, True) for t in sorted(some_s)]

    def warmup(self, progress: bool = True) -> None:
        """Compile every bucket. The caller then calls `arm()`, once every engine of the
        process has compiled (the compile guard counts the whole process's compiles)."""
        if self.lora is not None:
            self.lora.warmup()
        compile_buckets(self, self.compile_step, progress)

    def load_lora(self, slot: int, adapter: Any) -> None:
        """Write `adapter` (a `models.lora_loader.LoraAdapter`) into device slot `slot`,
        queued after every step already dispatched (`device/lora_slots.py`)."""
        if self.lora is None:
            raise ValueError("load_lora: this runner was built without LoRA (enable_lora)")
        try:
            self.lora.load(slot, adapter.weights)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - classified for the engine
            raise self._failed(f"loading a LoRA adapter into slot {slot}", e) from e

    @property
    def _lora_stacks(self) -> LoraStacks | None:
        return None if self.lora is None else self.lora.stacks

    def _place(self, batch: StepBatch) -> StepTree:
        """The batch's inputs on device; a batch without a grammar mask gets this bucket's
        device-resident one (never sent: `constrained` is all False, so it is not read)."""
        inputs, sampling, plp = place_inputs(to_step_inputs(batch, self.lora is not None),
                                             self.inputs_sharding)
        if sampling.mask.bitmask is None:
            sampling = sampling.with_mask(self._no_mask_of(batch.num_seqs_bucket))
        return inputs, sampling, plp

    def _no_mask_of(self, S: int) -> jax.Array:
        """i32[S, W] on device, made once per seqs bucket: the mask of a step without one."""
        if S not in self._no_mask:
            self._no_mask[S] = place_inputs(  # type: ignore[assignment]
                np.zeros((S, bitmask_words(self.shape.vocab_size)), np.int32),
                self.inputs_sharding)
        return self._no_mask[S]

    def compile_step(self, batch: StepBatch) -> None:
        """Compile (ahead of time, without running) the executables a step of `batch`'s
        shapes calls, exactly as `dispatch` will call them: the same arguments and shardings,
        so jit's cache then holds them and serving compiles nothing. Running an all-padding
        batch would compile the same, but costs a full forward per bucket at start-up (seconds
        each for the large token buckets on a CPU)."""
        inputs, sampling, plp = self._place(batch)
        fwd = forward_jit.lower(self.params, self.kv_pages, inputs, self._feed,
                                cfg=self.model_cfg, attn_impl=self.attn_impl, mesh=self.mesh,
                                expert_parallel=self.expert_parallel,
                                aux_layers=self.aux_layers, lora=self._lora_stacks)
        compiled = fwd.compile()
        # The forward's outputs as the sampler will receive them: placed by the mesh under
        # tensor parallelism, else uncommitted like everything else on one device (a
        # committed placeholder would key a different executable than serving calls).
        _, logits, hidden, _ = jax.tree.map(
            lambda info, sharding: jax.ShapeDtypeStruct(
                info.shape, info.dtype, sharding=None if self.mesh is None else sharding),
            fwd.out_info, compiled.output_shardings)
        sample_jit.lower(logits, sampling, apply_penalty=batch.penalties.history.shape[1] > 0,
                         feed_len=self.feed_len, invariant=self.invariant).compile()
        if plp is not None:
            prompt_logprobs_jit.lower(self.params, hidden, plp, cfg=self.model_cfg,
                                      invariant=self.invariant).compile()

    def arm(self) -> None:
        self.guard.arm()

    def execute(self, batch: StepBatch) -> StepResult:
        return self.collect(self.dispatch(batch))

    def dispatch(self, batch: StepBatch, late_mask: LateMask | None = None
                 ) -> "ModelPending":
        """Queue one step (returns before the device finishes it); RunnerFailed (fatal or not,
        see the module docstring) when it fails. `late_mask` (`runner.LateMask`): called after
        the forward is queued, for the sampler's grammar mask (its own errors pass through)."""
        try:
            # Replicated on the mesh under tensor parallelism, the same at warmup and
            # serving, so the compiled step's input shardings never change (no recompile).
            inputs, sampling, plp = self._place(batch)
        except Exception as e:  # noqa: BLE001 - classified for the engine
            raise self._failed("placing the step's inputs on the device", e) from e
        try:
            self.kv_pages, logits, hidden, aux = forward_jit(
                self.params, self.kv_pages, inputs, self._feed, cfg=self.model_cfg,
                attn_impl=self.attn_impl, mesh=self.mesh,
                expert_parallel=self.expert_parallel, aux_layers=self.aux_layers,
                lora=self._lora_stacks)
            scored = None if plp is None else prompt_logprobs_jit(
                self.params, hidden, plp, cfg=self.model_cfg, invariant=self.invariant)
        except Exception as e:  # noqa: BLE001 - classified for the engine
            raise self._failed("the compiled step", e) from e
        if late_mask is not None:
            bitmask, constrained = late_mask()  # the host works while the forward runs
            try:
                sampling = self._mask(sampling, bitmask, constrained)
            except Exception as e:  # noqa: BLE001 - classified for the engine
                raise self._failed("placing the step's grammar mask", e) from e
        try:
            out, feed = sample_jit(logits, sampling,
                                   apply_penalty=batch.penalties.history.shape[1] > 0,
                                   feed_len=self.feed_len, invariant=self.invariant)
        except Exception as e:  # noqa: BLE001 - classified for the engine
            raise self._failed("the compiled step", e) from e
        # Committed to the inputs' placement: the forward is compiled for that one sharding
        # (a no-op where the sampler's output already has it).
        self._feed = feed if self.inputs_sharding is None else \
            jax.device_put(feed, self.inputs_sharding)
        return ModelPending(out, scored, aux)

    def _mask(self, sampling: SamplingTensors, bitmask: np.ndarray | None,
              constrained: np.ndarray) -> SamplingTensors:
        """`sampling` with a late grammar mask (None: this bucket's unused one)."""
        S = len(constrained)
        placed = place_inputs((bitmask, constrained), self.inputs_sharding)  # type: ignore
        return sampling.with_mask(self._no_mask_of(S) if bitmask is None else placed[0],
                                  placed[1])

    def collect(self, pending: "ModelPending") -> StepResult:
        """Wait for a dispatched step and copy its result to the host (any failure here is
        fatal: the device ran the step, or failed in it)."""
        out, scored = pending.out, pending.scored
        try:
            tokens, logprob, top_ids, top_lps, scored = jax.device_get(
                (out.tokens, out.logprob, out.top_ids, out.top_logprobs, scored))
        except Exception as e:  # noqa: BLE001 - classified for the engine
            raise RunnerFailed(f"the compiled step failed on the device: {e!r}",
                               fatal=True) from e
        if scored is None:
            return StepResult(tokens, logprob, top_ids, top_lps)
        return StepResult(tokens, logprob, top_ids, top_lps, prompt_logprob=scored.logprob,
                          prompt_top_ids=scored.top_ids,
                          prompt_top_logprobs=scored.top_logprobs)

    def _failed(self, what: str, error: Exception) -> RunnerFailed:
        """`error` as a RunnerFailed: fatal when the KV buffer is gone or the device failed."""
        kv_lost = self.kv_pages.is_deleted()
        fatal = kv_lost or isinstance(error, jax.errors.JaxRuntimeError)
        why = "; the KV cache buffer was consumed" if kv_lost else ""
        return RunnerFailed(f"{what} failed: {error!r}{why}", fatal=fatal)

    def close(self) -> None:
        self.guard.close()
