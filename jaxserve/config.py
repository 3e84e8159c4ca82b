"""Frozen configuration built once at the edge (CLI / API) and passed down.

Environment variables are read at the edge only: `runtime_config.RuntimeConfig.from_env` and the
`jaxserve` command (`jaxserve.cli`). Every section is a frozen dataclass whose
`__post_init__` validates its own fields and raises ValueError naming the bad one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxserve.lora_config import LoRAConfig
from jaxserve.runtime_config import (DistributedConfig, RuntimeConfig,  # noqa: F401 (re-exported)
                                     apply_runtime)
from jaxserve.slo_config import (SCHEDULING_POLICIES, SLO_ADMISSIONS,  # noqa: F401 (re-exported)
                                 SloTargets)
from jaxserve.spec_config import SpeculativeConfig  # noqa: F401  (re-exported: config layer)

if TYPE_CHECKING:
    from jaxserve.models.kv_groups import KVGroups

DTYPES = ("float32", "bfloat16", "float16")
# KV cache: "auto" (or None) = the model's dtype; int8 / fp8 (float8_e4m3fn) pages are stored
# quantized with one f32 scale per token, KV head and K-or-V (kernels_pallas.QuantizedKV).
KV_CACHE_DTYPES = ("auto", *DTYPES, "int8", "fp8")
DENSE_IMPLS = ("auto", "xla", "cpu")
# The C++ dense kernel's instruction set (kernels_pallas/cpu_build.py builds one variant per
# ISA): auto = the best this CPU runs (a runtime cpuid check); one it cannot run fails at load.
DENSE_ISAS = ("auto", "avx512_vnni", "avx512", "avx2", "native")
# Weight storage (`jaxserve.models.quant`): auto keeps a checkpoint's own quantization (GGUF
# blocks) and float weights float; none dequantizes everything; a scheme quantizes at load.
QUANTIZATION_SCHEMES = ("int8", "fp8", "int4")
QUANTIZATIONS = ("auto", "none", *QUANTIZATION_SCHEMES)
FP8_ACTIVATIONS = ("auto", "on", "off")
INT8_ACTIVATIONS = ("auto", "on", "off")
INT8_ACTIVATION_GROUP_SIZES = (8, 16, 32)
IDLE_WINDOW_POLICIES = ("adaptive", "always")  # serving/idle_window.py


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching policy knobs (the TTFT / ITL / throughput trade-off)."""

    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 512  # tokens (decodes + prefill chunks) in one step
    # Tokens of a step that carries decodes (<= max_num_batched_tokens): bounds how long a
    # prefill chunk stalls the streams already generating (their inter-token latency), while
    # a step of prefills alone may take the whole budget. None: max_num_batched_tokens.
    decode_token_budget: int | None = None
    max_model_len: int = 2048  # prompt + generated tokens of one sequence
    page_size: int = 16  # tokens per KV page
    num_pages: int = 1024  # KV pages incl. the trash page 0 (derived from a memory budget)
    enable_prefix_caching: bool = True
    # The model's KV groups (`models/kv_groups.py`): a block table per group, sliding ones
    # freeing pages that leave the window. None: one table for every layer.
    kv_groups: "KVGroups | None" = None
    # Sampler rows one step may hold (speculative decoding: every verified position is a
    # row; `engine.sizing` derives it): admission stops before a step's sequences plus its
    # proposals would pass it. None: max_num_seqs (one row per sequence).
    max_num_rows: int | None = None
    # Latency targets (`slo_config.SloTargets`, seconds per priority level; None: none). With
    # either set the step's token budget is chosen per step from a fitted step-time model
    # (`engine/slo_policy.py`); without, the static budgets above are the policy.
    ttft_slo: SloTargets | None = None
    itl_slo: SloTargets | None = None
    # "reject": a request whose TTFT target the predicted wait already misses is refused
    # (`engine.errors.SloUnattainable`); "queue": it waits, and is counted.
    slo_admission: str = "queue"
    # "priority": (priority, arrival) order; "fcfs": arrival order (a request's priority must
    # then be 0, vLLM's rule).
    scheduling_policy: str = "priority"

    @property
    def kv_windows(self) -> tuple[int | None, ...]:
        """Each KV group's window (None: global); one global group without KV groups."""
        return (None,) if self.kv_groups is None else self.kv_groups.windows

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2 (page 0 is reserved)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode in one step.
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs}")
        d = self.decode_token_budget
        if d is not None and not self.max_num_seqs <= d <= self.max_num_batched_tokens:
            raise ValueError(f"decode_token_budget={d} must be in [max_num_seqs="
                             f"{self.max_num_seqs}, max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}]")
        check_slo_fields(self)

    @property
    def slo_enabled(self) -> bool:
        return self.ttft_slo is not None or self.itl_slo is not None

    def level(self, priority: int) -> int:
        """The level a request of `priority` is ranked at: its priority, or 0 for every
        request under fcfs (arrival order only; the policy may change on a running server)."""
        return 0 if self.scheduling_policy == "fcfs" else priority

    def step_budget(self, established_decodes: bool) -> int:
        """Tokens of a step: the whole budget, unless it carries a decode of a stream past
        its first token (then decode_token_budget: how long a prefill chunk may stall that
        stream). A stream with only its first token may wait one big step more, so prompts
        arriving a moment apart are still prefilled together (and then decode in lockstep)."""
        if established_decodes and self.decode_token_budget is not None:
            return self.decode_token_budget
        return self.max_num_batched_tokens

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)


def check_slo_fields(cfg: "SchedulerConfig | EngineConfig") -> None:
    """The SLO and policy fields, as both configs hold them (one check, two owners)."""
    for name in ("ttft_slo", "itl_slo"):
        v = getattr(cfg, name)
        if v is not None and not isinstance(v, SloTargets):
            raise ValueError(f"{name} must be an SloTargets (SloTargets.parse), got "
                             f"{type(v).__name__}")
    if cfg.slo_admission not in SLO_ADMISSIONS:
        raise ValueError(f"slo_admission={cfg.slo_admission!r} must be one of {SLO_ADMISSIONS}")
    if cfg.slo_admission == "reject" and cfg.ttft_slo is None:
        raise ValueError("slo_admission='reject' needs ttft_slo (requests are refused when "
                         "their predicted time to first token passes it)")
    if cfg.scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy={cfg.scheduling_policy!r} must be one of "
                         f"{SCHEDULING_POLICIES}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything a user chooses for one engine; derived sizes (pages, buckets): `engine.sizing`."""

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "float32"
    # None / "auto": same as dtype, but bfloat16 for quantized weights served in float32
    # (serving/build.py `kv_cache_dtype` says why); int8 / fp8: quantized pages.
    kv_cache_dtype: str | None = None
    max_num_seqs: int = 32
    # A burst of arrivals is prefilled in one step of up to 2048 tokens (vLLM-CPU's server
    # default), which keeps requests that arrive together in step with each other; a step
    # that carries decodes takes at most decode_token_budget tokens, so a prefill chunk
    # stalls running streams for one step of that size at most. decode_token_budget is
    # raised to max_num_seqs and capped at max_num_batched_tokens; None: no separate cap.
    # 256, not 512: at concurrency 32 a third of all inter-token gaps are steps that carry a
    # prefill chunk, so p99 ITL is that step's length (bundled model, 2-core CPU: ~330 ms at
    # 256 tokens, ~640 ms at 512), and the smaller chunk still prefills the arrivals of a
    # steady stream (32 x 256-token prompts, 128 new tokens each: ~64 prompt tokens per step
    # on average) with the same throughput (docs/scheduling.md has the figures).
    max_num_batched_tokens: int = 2048
    decode_token_budget: int | None = 256
    # Serving: an idle engine woken by a request waits this long for others arriving with it,
    # so a burst is prefilled in one step (the fronts only; offline calls have theirs at once).
    idle_batch_window_ms: float = 20.0
    # "adaptive": wait only when the previous wake-up had company (a lone request at
    # concurrency 1 does not pay the window in its TTFT); "always": every wake-up waits.
    # serving/idle_window.py says why.
    idle_batch_window_policy: str = "adaptive"
    max_model_len: int | None = None  # None: min(model's max_position_embeddings, 4096)
    page_size: int = 16
    kv_cache_memory: int | None = None  # bytes for KV pages; None: a fraction of free memory
    kv_cache_memory_fraction: float = 0.8
    enable_prefix_caching: bool = True
    # Overlap host and device: dispatch step N+1 (its decode tokens fed on the device from step
    # N's sampler) before applying step N's results. Off: one step at a time (debugging).
    async_scheduling: bool = True
    attention_impl: str = "auto"  # auto | reference | cpu | pallas_tpu | pallas_gpu
    # Dense projections: "cpu" packs the weights for the C++ kernel (kernels_pallas/dense_cpu);
    # "xla" keeps XLA's dot; "auto": cpu on a CPU host with float32 weights and no tensor
    # parallelism, else xla. An MoE model's float32 / bfloat16 experts go to the C++ grouped
    # kernel (kernels_pallas/moe_grouped_cpu) on a CPU host under auto / cpu; xla: the tile loop.
    dense_impl: str = "auto"
    # The C++ dense kernel's instruction set: auto | avx512 | avx2 | native (DENSE_ISAS above;
    # avx2 on an AVX-512 host: the other path, for tests and figures).
    dense_isa: str = "auto"
    # Dense weights: auto | none | int8 | fp8 | int4 (QUANTIZATIONS above;
    # docs/quantization.md). Group size: input rows per scale (None: int8 / fp8 one scale per output
    # column, int4 the first of 128 / 64 / 32 that divides the layer's input size).
    quantization: str = "auto"
    quantization_group_size: int | None = None
    quantize_lm_head: bool = False  # the lm_head (a tied embedding) too, with --quantization
    # fp8 only: quantize activations per token too and run fp8 x fp8 dots (W8A8); auto: where
    # the device has fp8 matmuls (CUDA compute capability >= 8.9: Ada, Hopper, Blackwell).
    fp8_activations: str = "auto"
    # int8 / int4 weights on the C++ dense kernel: quantize activations per row to int8 in
    # groups of up to 32 and run integer dots (W8A8 / W4A8, llama.cpp's way with its blocks;
    # kernels_pallas/dense_qdot_cpu.py); auto: where this CPU's kernel ISA has them for the
    # weight (int8: AVX-512 VNNI; int4: AVX-512 or AVX2); on: a weight that cannot is an
    # error at load; off: activations stay float (W8A16 / W4A16).
    int8_activations: str = "auto"
    # Activations per int8 scale (8 | 16 | 32; a weight group smaller than this sets its own):
    # 32 is llama.cpp's Q8 activation block; smaller groups round less and run slower
    # (docs/quantization.md has the figures).
    int8_activation_group_size: int = 32
    # None: 1, 2, 4, 8, multiples of 8 to 64, then 4 per octave up to the token budget
    token_buckets: tuple[int, ...] | None = None
    # None: one per token bucket, min(tokens, max_num_seqs); else every (tokens, seqs) pair
    seq_buckets: tuple[int, ...] | None = None
    seed: int = 0  # seeds drawn for requests that give none
    # JAX persistent compilation cache (process-wide; applied once per build by serving.build).
    # None: leave JAX's setting as it is (the CLI sets it from JAXSERVE_COMPILATION_CACHE_DIR).
    compilation_cache_dir: str | None = None
    # Devices one engine's step is split over (weights by head / MLP column / vocabulary, KV
    # pages by KV head; see jaxserve.models.placement). 1: a single device.
    tensor_parallel_size: int = 1
    # MoE models: split the experts whole over the tensor-parallel devices (E / tp experts
    # each) instead of splitting every expert's width; attention stays tensor parallel
    # (jaxserve.models.moe_parallel). Needs tensor_parallel_size > 1 and a model with experts.
    enable_expert_parallel: bool = False
    # Independent engine replicas (each its own scheduler, KV pages and tensor_parallel_size
    # devices) behind one server; requests go to the least loaded replica, or to one that
    # holds their prompt's prefix (jaxserve.serving.router). Needs data x tensor devices.
    data_parallel_size: int = 1
    # Several hosts: seconds without a step after which process 0 tells the others it is
    # alive (they wait inside a collective, which gloo abandons after 30 minutes).
    multihost_keepalive_s: float = 60.0
    # Soak and chaos testing only: a request whose prompt starts with this token id fails in
    # its first step (`engine.fault_injection`), so a test can send requests that fail on
    # purpose and check that the others carry on. None: off (always, in production).
    fault_injection_token: int | None = None
    # Speculative decoding (vLLM's --speculative-config; `spec_config.SpeculativeConfig`):
    # proposals verified in the ordinary step (docs/serving/speculative.md). None: off.
    speculative_config: SpeculativeConfig | None = None
    # Latency targets, seconds per priority level (`slo_config.SloTargets`: a number, or
    # "0=0.5,1=2", or a mapping): with either, the scheduler chooses each step's token budget
    # among the compiled buckets from a step-time model it fits online, so running streams
    # meet ITL while waiting prompts are admitted as fast as that allows
    # (docs/scheduling.md). None: the static budgets above.
    ttft_slo: SloTargets | None = None
    itl_slo: SloTargets | None = None
    slo_admission: str = "queue"  # queue | reject (SchedulerConfig says what each does)
    scheduling_policy: str = "priority"  # priority | fcfs (vLLM's --scheduling-policy)
    # A request's token ids and logprobs bit-identical whatever else shares its steps, however
    # its prompt is chunked, with or without prefix-cache hits, preemption or speculation
    # (greedy and seeded; docs/batch-invariance.md): logprobs by a fixed summation order, and
    # one fixed (tokens, seqs) shape for every step unless the step runs only row-invariant
    # kernels (the CPU attention and C++ dense kernels); `serving/batch_invariant.py` applies
    # it and refuses what cannot be invariant (the Pallas attention kernels, MoE models).
    batch_invariant: bool = False
    # Multi-LoRA (vLLM's --enable-lora and its options; `lora_config.LoRAConfig`): adapters
    # served beside the base model, one per request, mixed in a step (docs/serving/lora.md).
    # None: off.
    lora_config: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if self.lora_config is not None and not isinstance(self.lora_config, LoRAConfig):
            raise ValueError("lora_config must be a LoRAConfig (LoRAConfig.from_options builds "
                             f"it from vLLM's option names), got {type(self.lora_config).__name__}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant={self.batch_invariant!r} must be true or false")
        for name in ("ttft_slo", "itl_slo"):  # LLM(ttft_slo=0.5): accept what parse takes
            object.__setattr__(self, name, SloTargets.parse(getattr(self, name), name))
        check_slo_fields(self)
        spec = self.speculative_config
        if spec is not None:
            if not isinstance(spec, SpeculativeConfig):
                raise ValueError("speculative_config must be a SpeculativeConfig (build it "
                                 "with SpeculativeConfig.from_dict / from_json), got "
                                 f"{type(spec).__name__}")
            spec.check_target(self.tensor_parallel_size)
        for name in ("tensor_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel={self.enable_expert_parallel!r} must be "
                             "true or false")
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            # Data-parallel replicas are separate engines: experts are never split over them.
            raise ValueError("enable_expert_parallel=True needs tensor_parallel_size > 1 (the "
                             "experts are split over one engine's tensor-parallel devices; "
                             f"got {self.tensor_parallel_size})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; choose one of {DTYPES}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; "
                             f"choose one of {KV_CACHE_DTYPES}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        d = self.decode_token_budget
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"decode_token_budget={d!r} must be a positive integer or None")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len!r} must be a positive integer")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory!r} must be positive bytes")
        if self.fault_injection_token is not None and self.fault_injection_token < 0:
            raise ValueError(f"fault_injection_token={self.fault_injection_token} must be a "
                             "token id (>= 0) or None")
        if self.dense_impl not in DENSE_IMPLS:
            raise ValueError(f"dense_impl={self.dense_impl!r} must be one of {DENSE_IMPLS}")
        if self.dense_isa not in DENSE_ISAS:
            raise ValueError(f"dense_isa={self.dense_isa!r} must be one of {DENSE_ISAS}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} must be one of "
                             f"{QUANTIZATIONS}")
        g = self.quantization_group_size
        if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < 2 or g % 2):
            raise ValueError(f"quantization_group_size={g!r} must be an even integer >= 2")
        if self.fp8_activations not in FP8_ACTIVATIONS:
            raise ValueError(f"fp8_activations={self.fp8_activations!r} must be one of "
                             f"{FP8_ACTIVATIONS}")
        if self.int8_activations not in INT8_ACTIVATIONS:
            raise ValueError(f"int8_activations={self.int8_activations!r} must be one of "
                             f"{INT8_ACTIVATIONS}")
        if self.int8_activation_group_size not in INT8_ACTIVATION_GROUP_SIZES:
            raise ValueError(f"int8_activation_group_size={self.int8_activation_group_size!r} "
                             f"must be one of {INT8_ACTIVATION_GROUP_SIZES}")
        if self.int8_activations == "on" and self.quantization in ("none", "fp8"):
            raise ValueError(f"int8_activations='on' needs int8 or int4 weights, not "
                             f"quantization={self.quantization!r}")
        if self.int8_activations == "on" and self.dense_impl == "xla":
            raise ValueError("int8_activations='on' runs in the C++ dense kernel, which "
                             "dense_impl='xla' turns off")
        if self.fp8_activations == "on" and self.quantization != "fp8":
            raise ValueError(f"fp8_activations='on' needs quantization='fp8', not "
                             f"{self.quantization!r}")
        if not 0 <= self.idle_batch_window_ms <= 1000:
            raise ValueError(f"idle_batch_window_ms={self.idle_batch_window_ms!r} must be in "
                             "[0, 1000]")
        if self.idle_batch_window_policy not in IDLE_WINDOW_POLICIES:
            raise ValueError(f"idle_batch_window_policy={self.idle_batch_window_policy!r} must "
                             f"be one of {IDLE_WINDOW_POLICIES}")
        if not self.multihost_keepalive_s > 0:
            raise ValueError(f"multihost_keepalive_s={self.multihost_keepalive_s!r} must be > 0")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction={self.kv_cache_memory_fraction} must be "
                             "in (0, 1]")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                             f"max_num_seqs={self.max_num_seqs}")
        for name in ("token_buckets", "seq_buckets"):
            b = getattr(self, name)
            if b is not None and (not b or list(b) != sorted(set(b)) or b[0] < 1):
                raise ValueError(f"{name}={b!r} must be strictly increasing positive integers")
