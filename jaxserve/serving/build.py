"""Frozen config -> running engines: the one assembly path of every entry point.

`LLM`, `jaxserve serve`, `jaxserve batch`, the benchmarks and the followers of a multi-host job
all build their engines here. Data flow of `build_engines(config)`:
  `_apply_runtime`: the process-wide JAX settings (compilation cache), once per build
  for each data-parallel replica (row i of a (data, model) mesh of the local devices):
    `_place`: load the checkpoint (unless a LoadedModel is given) straight into the replica's
    tensor-parallel shardings (`models.placement`); a draft model too (`spec_build.py`)
  -> `_kv_budget`: one free-memory figure read after every replica's weights are placed (the
    smallest over processes under `jax.distributed`)
  -> `_make_runner`: `sizing.plan_engine` (pages, buckets) and the ModelRunner (KV pages on
    device; a draft's proposer) -> `Engine(config, plan, runner, tokenizer, eos ids)`
  -> `warm_up`: compile every bucket (and draft round) of every replica, then arm the guards.
`served.py` runs the engines: in lockstep for offline use, or each on its own loop thread
for the servers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.config import EngineConfig, RuntimeConfig, apply_runtime
from jaxserve.device.model_runner import ModelRunner
from jaxserve.device.multihost import Follower, LeaderRunner, agree_min
from jaxserve.device.multihost_spec import LeaderDrafter
from jaxserve.engine.engine import Engine
from jaxserve.engine.fault_injection import with_faults
from jaxserve.engine.sizing import (EnginePlan, available_host_memory, free_device_memory,
                                    plan_engine)
from jaxserve.kernels_pallas import KernelGeometry, is_quantized_dtype, page_head_dim, select_impl
from jaxserve.kernels_pallas.cpu_build import dense_kernel_target
from jaxserve.models import placement
from jaxserve.models.config import ModelConfig
from jaxserve.models.families import ModelParams
from jaxserve.models.loading import LoadedModel, load_model
from jaxserve.models.packing import can_pack, pack_experts_where_possible, pack_params
from jaxserve.models.quant import QuantizedWeight, WeightQuant, weight_bytes, weight_quant
from jaxserve.models.quantized_params import dequantized_params, quantize_params
from jaxserve.models.paged import MODEL_AXIS
from jaxserve.device.lora_slots import DeviceLoraSlots
from jaxserve.serving import batch_invariant, lora_build, spec_build

log = logging.getLogger(__name__)

DATA_AXIS = "data"  # replicas; each row of the mesh is one replica's "model" axis
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# KV cache dtypes beyond the float ones: pages stored quantized, an f32 scale per row beside.
_KV_DTYPES = {**_DTYPES, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
_KV_SCALE_BYTES = 4


def kv_cache_dtype(config: EngineConfig, weights_quantized: bool = False) -> jnp.dtype:
    """The KV pages' dtype: kv_cache_dtype; for None / "auto" the model's dtype, except that
    quantized weights (a GGUF's blocks, or a scheme applied at load) served in float32 get
    bfloat16 pages.

    Why: the weights' own rounding (int8 and Q8_0: up to 2^-8 of a group's largest value per
    entry; 4-bit far more) already exceeds bfloat16's 2^-9 relative rounding of K and V, so
    32-bit pages buy no accuracy, while every decode step reads all of a sequence's K/V: at
    32 sequences of ~400 tokens that read is half the CPU step at float32 (bundled model:
    ~570 MB a step, ~20 GB/s), and 16-bit pages make the step ~20% shorter. It is what
    llama.cpp (16-bit cache by default) and vLLM (GGUF runs in 16 bits) do with these files.
    `--kv-cache-dtype float32` keeps 32-bit pages; float weights keep the model's dtype."""
    name = config.kv_cache_dtype
    if name in (None, "auto"):
        name = "bfloat16" if weights_quantized and config.dtype == "float32" else config.dtype
    return jnp.dtype(_KV_DTYPES[name])


def has_quantized_weights(params: ModelParams) -> bool:
    """Whether any of the params' weights is stored quantized (before packing for the CPU
    kernel, which turns QuantizedWeights into panels)."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return any(isinstance(leaf, QuantizedWeight) for leaf in leaves)


def build_engine(config: EngineConfig, model: LoadedModel | None = None,
                 warmup: bool = True, progress: bool = True) -> Engine:
    """Load (unless given), size, place and compile: a ready-to-step Engine.

    Under `jax.distributed` (several processes) this runs on process 0 only, and its runner
    announces every step to the other processes, which run `build_follower` + `follow`.
    """
    if jax.process_index() != 0:
        raise ValueError(f"build_engine on process {jax.process_index()} of "
                         f"{jax.process_count()}: only process 0 runs the engine; the others "
                         "run multihost.follow(build_follower(config))")
    _apply_runtime(config)
    placed = _place(config, model, None)
    draft = spec_build.load_drafter(config, placed.model, _weight_quant(config),
                                    functools.partial(_dense_params, config))
    plan, runner, proposer = _make_runner(config, placed, _kv_budget([placed]), draft)
    if jax.process_count() > 1:
        runner = LeaderRunner(runner, config.multihost_keepalive_s)
        if proposer is not None:  # its rounds are announced too
            proposer.drafter = LeaderDrafter(proposer.drafter, runner)  # type: ignore
    engine = Engine(config, plan, with_faults(config, runner), placed.model.tokenizer,
                    placed.model.config.eos_token_ids, proposer=proposer,
                    lora_loader=lora_build.adapter_loader(config, placed.model.config))
    if warmup:
        warm_up([engine], progress)
    return engine


def build_follower(config: EngineConfig) -> Follower:
    """A process > 0's share of a multi-host engine: the same runner process 0 builds (same
    mesh, shapes and KV pages) and speculative drafter, driven by `multihost.follow`."""
    if jax.process_count() == 1 or jax.process_index() == 0:
        raise ValueError(f"build_follower on process {jax.process_index()} of "
                         f"{jax.process_count()}: it is for processes > 0 of a "
                         "jax.distributed job")
    _apply_runtime(config)
    placed = _place(config, None, None)
    draft = spec_build.load_drafter(config, placed.model, _weight_quant(config),
                                    functools.partial(_dense_params, config))
    _, runner, proposer = _make_runner(config, placed, _kv_budget([placed]), draft)
    return Follower(runner, None if proposer is None else proposer.drafter)


def build_engines(config: EngineConfig, model: LoadedModel | None = None,
                  warmup: bool = True, progress: bool = True) -> list[Engine]:
    """`data_parallel_size` independent engines, replica i on row i of a (data, model) mesh
    of the local devices; each has its own scheduler, KV pages and compiled step.

    Every replica's weights are placed before free memory is measured, and all replicas size
    their KV pages from the same (smallest) figure, so they hold equal page counts. Every
    replica compiles before any compile guard is armed: replicas run on different devices, so
    each compiles its own executables, and a guard armed early would count the next
    replica's warmup as serving compiles.
    """
    dp = config.data_parallel_size
    if dp == 1:
        return [build_engine(config, model, warmup, progress)]
    if jax.process_count() > 1:
        raise ValueError(f"data_parallel_size={dp} over {jax.process_count()} processes: data "
                         "parallelism is per host; across hosts run one job per replica")
    _apply_runtime(config)
    # Given no model, each replica loads the checkpoint straight onto its own devices (a
    # memory-mapped re-read per replica) rather than staging one copy on device 0.
    placed = [_place(config, model, row)
              for row in replica_device_rows(dp, config.tensor_parallel_size)]
    draft = spec_build.load_drafter(config, placed[0].model, _weight_quant(config),
                                    functools.partial(_dense_params, config))
    free = _kv_budget(placed)
    engines = []
    for p in placed:
        plan, runner, proposer = _make_runner(config, p, free, draft)
        engines.append(Engine(config, plan, with_faults(config, runner), p.model.tokenizer,
                              p.model.config.eos_token_ids, proposer=proposer,
                              lora_loader=lora_build.adapter_loader(config, p.model.config)))
    if warmup:
        warm_up(engines, progress)
    return engines


@dataclasses.dataclass(frozen=True)
class _Placed:
    """A model's weights on one engine's devices."""

    model: LoadedModel
    run_cfg: ModelConfig  # KV heads replicated where tensor parallelism needs it
    params: ModelParams
    mesh: Mesh | None
    expert_parallel: bool  # MoE experts split whole over the mesh (models/moe_parallel.py)
    device: jax.Device  # where free memory is read
    weights_quantized: bool  # any weight stored quantized (the KV pages' "auto" dtype)
    lora: DeviceLoraSlots | None = None  # the adapter stacks (created before KV is sized)


def _apply_runtime(config: EngineConfig) -> None:
    """The process-wide JAX settings of `config`, once per build, before any replica is
    placed or compiled."""
    if config.compilation_cache_dir:
        apply_runtime(RuntimeConfig(compilation_cache_dir=config.compilation_cache_dir))


def _place(config: EngineConfig, model: LoadedModel | None,
           devices: Sequence[jax.Device] | None) -> _Placed:
    """Load (unless given) and place the weights on `devices` (None: the first tp devices of
    all processes, or the first local device)."""
    tp = config.tensor_parallel_size
    lora_build.check_supported(config)
    if jax.process_count() > 1 and tp != jax.device_count():
        # A mesh of some processes' devices would leave the others following a step they
        # have no part in.
        raise ValueError(f"tensor_parallel_size={tp}: over {jax.process_count()} processes "
                         f"the step must span all {jax.device_count()} devices")
    mesh = None
    if tp > 1 or devices is not None:
        mesh = placement.make_tp_mesh(tp, None if devices is None else list(devices))
    # A model not given loads straight into its shardings (each device reads only its own
    # slice of the checkpoint); place_params then hands those params back unchanged.
    loaded_here = model is None
    quant = _weight_quant(config)
    ep = config.enable_expert_parallel
    if model is None:
        model = load_model(config.model, config.dtype, mesh=mesh, quant=quant,
                           expert_parallel=ep)
    else:  # a model loaded by the caller, maybe quantized otherwise: bring it to `quant`
        model = dataclasses.replace(model, params=_requantize(model.params, quant, config))
    log.info("weights: %.1f MiB (quantization=%s)", weight_bytes(model.params) / 2**20,
             quant.scheme + ("+fp8 activations" if quant.act_fp8 else ""))
    quantized = has_quantized_weights(model.params)
    if mesh is None:
        params = _dense_params(config, model.params)
        if loaded_here:  # nothing else holds the unpacked weights: let them go
            model = dataclasses.replace(model, params=params)
        run_cfg, device = model.config, jax.local_devices()[0]
    else:
        run_cfg = placement.tp_model_config(model.config, tp)
        params = placement.place_params(model.params, model.config, mesh, ep)
        device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    lora = lora_build.device_slots(config, model.config, run_cfg, mesh,
                                   lora_build.stacks_dtype(config, quantized))
    return _Placed(model, run_cfg, params, mesh, ep and mesh is not None, device, quantized,
                   lora)


def _requantize(params: ModelParams, quant: WeightQuant, config: EngineConfig) -> ModelParams:
    """A caller's loaded model's params stored as `quant` says, as `load_model(quant=...)`
    would have stored them: "none" dequantizes every quantized leaf to config.dtype, "auto"
    keeps what is there, a scheme quantizes the float leaves and requantizes quantized ones
    of another scheme or group size (`models/quantized_params.py`)."""
    if quant.scheme == "none":
        return dequantized_params(params, _DTYPES[config.dtype])
    if not quant.quantizes:
        return params
    return jax.tree.map(jnp.asarray, quantize_params(params, quant))


def _weight_quant(config: EngineConfig) -> WeightQuant:
    return weight_quant(config.quantization, config.quantization_group_size,
                        config.quantize_lm_head, config.fp8_activations, jax.local_devices()[0])


def _dense_params(config: EngineConfig, params: ModelParams) -> ModelParams:
    """`params` packed for the C++ dense kernel where `config.dense_impl` picks it (auto: on a
    CPU host with float32 weights; MoE experts too), else as they are but for the experts
    (`packing.pack_experts_where_possible`); the kernel runs `config.dense_isa` (an ISA this
    CPU cannot run is a ValueError here, at load)."""
    if config.dense_impl == "xla":
        return params
    why = can_pack(params)
    if why is None and jax.local_devices()[0].platform != "cpu":
        why = f"the device is {jax.local_devices()[0].platform}, not cpu"
    isa = None if config.dense_isa == "auto" else config.dense_isa
    if why is None and dense_kernel_target(isa) is None:
        why = "the C++ kernels could not be built (logged above)"
    if why is not None:
        if config.int8_activations == "on":
            raise ValueError(f"int8_activations='on' needs the C++ dense kernel, which cannot "
                             f"run here: {why}")
        if config.dense_impl == "cpu":
            log.warning("dense_impl=cpu: using XLA's dot instead, because %s", why)
        return pack_experts_where_possible(params, isa)
    # Quantized weights with float activations: the decode path that is ~10% faster at one
    # row but rounds otherwise than the many-row one, unless batch_invariant.
    return pack_params(params, isa=isa, int8_activations=config.int8_activations,
                       int8_activation_group_size=config.int8_activation_group_size,
                       fast_quant=not config.batch_invariant)


def _kv_budget(placed: list[_Placed]) -> int:
    """The free memory every engine of `placed` sizes its KV pages from: one figure, read
    after all their weights are placed, so equal engines get equal page counts.

    Devices that report their memory hold one engine each: the smallest of them. Devices that
    do not (CPU) share the host's memory between the engines. Under tensor parallelism the
    budget is still one device's free memory for all the pages: conservative (each device
    holds 1 / tp of them, or 1 / num_kv_heads when KV heads are replicated), and right on CPU
    where the virtual devices share host memory. Several processes must build the very same
    step, so they agree on the smallest budget of any of them.
    """
    reported = [free_device_memory(p.device) for p in placed]
    if None in reported:
        return agree_min(available_host_memory() // len(placed))
    return agree_min(min(r for r in reported if r is not None))


def _attention_impl(config: EngineConfig, cfg: ModelConfig,
                    kv_dtype: jnp.dtype) -> tuple[str, int | None]:
    """(attention implementation, head dim of its KV pages or None for the model's): what
    `config.attention_impl` picks on this host, asked whether it can run this model's pages
    (selector.select_impl with their geometry): 'auto' falls back to the reference with a
    warning where the kernel cannot, a kernel named explicitly is a ValueError saying why."""
    platform_impl = select_impl(config.attention_impl)
    geometry = KernelGeometry(page_head_dim(platform_impl, cfg.head_dim) or cfg.head_dim,
                              config.page_size, kv_dtype, cfg.num_heads // cfg.num_kv_heads)
    attn_impl = select_impl(config.attention_impl, geometry=geometry)
    if config.batch_invariant:
        batch_invariant.check_model(config, cfg)
        attn_impl = batch_invariant.attention_impl(config, attn_impl)
    return attn_impl, page_head_dim(attn_impl, cfg.head_dim)


def _make_runner(config: EngineConfig, placed: _Placed, free: int,
                 draft: spec_build.Drafter | None = None
                 ) -> tuple[EnginePlan, ModelRunner, spec_build.Proposer | None]:
    """The plan, the runner and (`draft`: a draft model or EAGLE-3 head) its proposer."""
    kv_dtype = kv_cache_dtype(config, placed.weights_quantized)
    attn_impl, kv_head_dim = _attention_impl(config, placed.run_cfg, kv_dtype)
    d_cfg = spec_build.kv_config(draft)
    d_attn, d_head = _attention_impl(config, d_cfg, kv_dtype) if d_cfg else (None, None)
    plan = plan_engine(config, placed.run_cfg, kv_dtype.itemsize, free, kv_head_dim,
                       _KV_SCALE_BYTES if is_quantized_dtype(kv_dtype) else 0, d_cfg, d_head,
                       placed.device.platform, config.batch_invariant and
                       batch_invariant.fixed_shapes(attn_impl, placed.params))
    devices = placed.mesh.devices.flat if placed.mesh is not None else [placed.device]
    log.info("KV cache: %d pages of %d tokens (%.1f MiB, %s), attention=%s, devices=%s",
             plan.scheduler.num_pages - 1, plan.scheduler.page_size,
             plan.kv_budget_bytes / 2**20, kv_dtype.name, attn_impl, [d.id for d in devices])
    runner = ModelRunner(placed.run_cfg, placed.params, plan.batch_shape,
                         plan.scheduler.num_pages, kv_dtype, attn_impl, kv_head_dim, placed.mesh,
                         placed.expert_parallel, spec_build.aux_layers(draft, placed.run_cfg),
                         config.batch_invariant, placed.lora)
    return plan, runner, spec_build.proposer(config, plan, draft, placed.run_cfg, placed.params,
                                             kv_dtype, d_attn, d_head, placed.mesh)


def warm_up(engines: list[Engine], progress: bool = True) -> None:
    """Compile every engine's buckets, then arm every compile guard; on failure release the
    runners (several hosts: the other processes stop following). What `build_engine(s)` run
    unless `warmup=False`; a caller that built without it (to time warmup apart, as
    scripts/bench/bench_buckets.py does) runs it here."""
    try:
        for i, eng in enumerate(engines):
            if len(engines) > 1:
                log.info("compiling data-parallel replica %d/%d", i + 1, len(engines))
            eng.runner.warmup(progress)
            eng.warmup_proposer()  # a draft model's rounds (none: a no-op)
            eng.calibrate_step_time()  # SLO targets: seed the step-time model (else a no-op)
        for eng in engines:
            eng.runner.arm()
    except BaseException:
        for eng in engines:
            eng.close()
        raise


def replica_device_rows(dp: int, tp: int) -> list[list[jax.Device]]:
    """The rows of the (data, model) mesh: the devices of each data-parallel replica."""
    devices = jax.local_devices()
    if dp * tp > len(devices):
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} "
                         f"devices; {len(devices)} local {devices[0].platform} device(s)")
    # make_mesh orders the devices by the interconnect's topology where it has one (TPU),
    # so each replica's tensor-parallel group sits on neighbouring chips.
    mesh = jax.make_mesh((dp, tp), (DATA_AXIS, MODEL_AXIS), devices=devices[:dp * tp])
    return [list(row) for row in mesh.devices]
