"""Flags shared by the `jaxserve` subcommands, generated from the config dataclasses.

`add_engine_flags` adds one flag per EngineConfig field (a new engine option becomes a flag by
itself) and `engine_config_from_args` reads them back into a validated EngineConfig;
`add_sampling_flags` adds one flag per SamplingParams field (from the sampling registry, with
per-command defaults) and `sampling_kwargs_from_args` reads the given ones back;
`add_distributed_flags` + `join_or_follow` make any subcommand a multi-host job.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import re
from typing import Any, Callable, Mapping, Sequence

from jaxserve.config import (DENSE_IMPLS, DENSE_ISAS, DTYPES, FP8_ACTIVATIONS,
                             IDLE_WINDOW_POLICIES, INT8_ACTIVATION_GROUP_SIZES, INT8_ACTIVATIONS, KV_CACHE_DTYPES, QUANTIZATIONS, SCHEDULING_POLICIES, SLO_ADMISSIONS, DistributedConfig, EngineConfig, SloTargets)
from jaxserve.engine import sampling_params
from jaxserve.lora_config import LORA_DTYPES, OPTION_NAMES as LORA_OPTION_NAMES, LoRAConfig
from jaxserve.spec_config import SpeculativeConfig

# The serve command raises this logger to INFO: the follower lines show like the lifecycle ones.
log = logging.getLogger("jaxserve.server")

_ENGINE_HELP = {
    "model": "model to load: an HF directory, a GGUF file or a jaxserve checkpoint; "
             "default: the bundled SmolLM2-135M-Instruct",
    "dtype": "parameter dtype",
    "kv_cache_dtype": "KV cache dtype: auto (= --dtype; bfloat16 for quantized weights in float32, "
                      "e.g. a GGUF's blocks), a float dtype, or int8 / fp8 pages "
                      "quantized with per-token scales (about half the bytes of bfloat16)",
    "max_num_seqs": "sequences in one step",
    "max_num_batched_tokens": "tokens (decodes + prefill chunks) in one step",
    "decode_token_budget": "tokens in a step that carries decodes (bounds how long a prefill "
                           "chunk stalls running streams); a step of prefills alone may use "
                           "--max-num-batched-tokens; 'none': no separate cap",
    "idle_batch_window_ms": "serving: an idle engine woken by a request waits this long for "
                            "others arriving with it, so a burst is prefilled in one step",
    "idle_batch_window_policy": "serving: adaptive (wait only when the previous wake-up had "
                                "company, so lone requests skip it) or always",
    "max_model_len": "prompt + generated tokens of one sequence (default: the model's, "
                     "capped at 4096)",
    "page_size": "tokens per KV page",
    "kv_cache_memory": "bytes for KV pages, e.g. 2GiB (default: a fraction of free memory)",
    "kv_cache_memory_fraction": "fraction of free memory for KV pages when --kv-cache-memory "
                                "is not given",
    "enable_prefix_caching": "reuse KV pages of shared prompt prefixes",
    "async_scheduling": "overlap the host's work with the device step (dispatch the next step "
                        "before reading this one's tokens); --no-async-scheduling: one at a "
                        "time",
    "attention_impl": "auto | reference | cpu | pallas_tpu | pallas_gpu",
    "dense_impl": "dense projections: cpu packs the weights for jaxserve's C++ kernel, xla "
                  "keeps XLA's dot; auto: cpu on a CPU host with float32 weights and no "
                  "tensor parallelism (MoE experts, float32 or bfloat16: the C++ grouped "
                  "kernel on a CPU host unless xla)",
    "dense_isa": "the C++ dense kernel's instruction set: auto picks the best this CPU runs "
                 "(avx512_vnni, avx512, else avx2; a runtime check); naming one this CPU cannot run fails "
                 "at load",
    "quantization": "dense weights: auto keeps a checkpoint's own quantization (GGUF Q8_0 / "
                    "Q4_0 / Q4_1 blocks) and float weights float; none dequantizes to --dtype; "
                    "int8 (per-channel, W8A16), fp8 (e4m3, per-channel) or int4 (grouped) "
                    "quantize at load",
    "quantization_group_size": "input rows per quantization scale (default: int8 / fp8 one "
                               "per output column, int4 128, 64 or 32)",
    "quantize_lm_head": "with --quantization, quantize the lm_head (a tied embedding) too",
    "fp8_activations": "--quantization fp8: also quantize activations (W8A8 fp8 dots); auto: "
                       "on GPUs with fp8 matmuls (compute capability >= 8.9)",
    "int8_activations": "int8 / int4 weights on the CPU: quantize activations per row to "
                        "int8 (groups of up to 32) and run integer dots (AVX-512 VNNI; int4 "
                        "also AVX-512 / AVX2); auto: where this CPU can; off: float "
                        "activations",
    "int8_activation_group_size": "activations per int8 scale with --int8-activations: 32 "
                                  "(llama.cpp's blocks, fastest), 16 or 8 (closer to float)",
    "token_buckets": "comma-separated step token buckets (default: 1, 2, 4, 8, multiples of 8 "
                     "to 64, then 4 per octave up to the token budget)",
    "seq_buckets": "comma-separated sequence buckets (default: one per token bucket)",
    "seed": "seed of the seeds drawn for requests that give none",
    "tensor_parallel_size": "devices one engine's step is split over (weights by head, MLP "
                            "column and vocabulary; KV pages by KV head)",
    "enable_expert_parallel": "MoE models: split the experts whole over the tensor-parallel "
                              "devices (E / tp each) instead of each expert's width; "
                              "attention stays tensor parallel",
    "multihost_keepalive_s": "several hosts: idle seconds after which process 0 tells the "
                             "others it is alive",
    "data_parallel_size": "independent engine replicas, each on its own tensor-parallel "
                          "devices; requests go to the least loaded or prefix-holding one",
    "fault_injection_token": "testing only: a request whose prompt starts with this token id "
                             "fails in its first step (finish reason error); others carry on",
    "speculative_config": "speculative decoding (vLLM's flag): a JSON object such as "
                          "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'; methods "
                          "ngram, draft_model, eagle3 (docs/serving/speculative.md); default: off",
    "ttft_slo": "time-to-first-token target in seconds: one for every priority level (2), "
                "per level (0=0.5,1=2) or both (2,0=0.5); with it or --itl-slo the scheduler "
                "picks each step's token budget from a step-time model it fits as it serves",
    "itl_slo": "inter-token latency target in seconds (same forms as --ttft-slo): steps that "
               "carry decodes are kept within it, prefill gets what is left",
    "slo_admission": "queue: a request whose predicted TTFT misses --ttft-slo waits (and is "
                     "counted); reject: it is refused (HTTP 429 / RESOURCE_EXHAUSTED with the "
                     "predicted wait)",
    "scheduling_policy": "priority: (priority, arrival) order; fcfs: arrival order (requests "
                         "must then have priority 0)",
    "batch_invariant": "a request's tokens and logprobs bit-identical whatever else is in its "
                       "steps, however its prompt is chunked, with prefix-cache hits, "
                       "preemption or speculation (greedy and seeded): invariant logprobs, "
                       "and one fixed step shape unless the CPU attention and C++ dense "
                       "kernels run the step (docs/batch-invariance.md); refuses the Pallas "
                       "attention kernels and MoE models",
    "compilation_cache_dir": "JAX persistent compilation cache directory (default: "
                             "$JAXSERVE_COMPILATION_CACHE_DIR or ~/.cache/jaxserve/xla)",
}
_CHOICES = {"dtype": DTYPES, "kv_cache_dtype": KV_CACHE_DTYPES, "dense_impl": DENSE_IMPLS,
            "dense_isa": DENSE_ISAS, "idle_batch_window_policy": IDLE_WINDOW_POLICIES,
            "quantization": QUANTIZATIONS, "fp8_activations": FP8_ACTIVATIONS,
            "int8_activations": INT8_ACTIVATIONS,
            "int8_activation_group_size": INT8_ACTIVATION_GROUP_SIZES,
            "slo_admission": SLO_ADMISSIONS, "scheduling_policy": SCHEDULING_POLICIES}
_METAVARS = {"speculative_config": "JSON", "ttft_slo": "SECONDS", "itl_slo": "SECONDS"}
_UNITS = {"": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1073741824, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers")


def parse_optional_int(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or 'none'") from None


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """`--speculative-config` JSON text -> SpeculativeConfig; argparse puts the flag's name
    before the parser's message, which names the bad key."""
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_slo(text: str, name: str) -> SloTargets:
    try:
        return SloTargets.parse(text, name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _engine_flag_type(field: dataclasses.Field) -> Any:
    kind = str(field.type)
    if field.name == "kv_cache_memory":
        return parse_bytes
    if field.name == "speculative_config":
        return parse_speculative_config
    if field.name in ("ttft_slo", "itl_slo"):
        return functools.partial(parse_slo, name=field.name)
    if kind == "int | None":
        return parse_optional_int
    if kind.startswith("tuple"):
        return parse_int_list
    if kind.startswith("int"):
        return int
    if kind.startswith("float"):
        return float
    return str


def add_engine_flags(p: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None,
                     exclude: Sequence[str] = ()) -> None:
    """One flag per EngineConfig field not in `exclude` (dest `engine_<name>`); `defaults`
    override EngineConfig's defaults for this command."""
    defaults = dict(defaults or {})
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    if set(defaults) - names:
        raise ValueError(f"no EngineConfig fields {sorted(set(defaults) - names)}")
    g = p.add_argument_group("engine (EngineConfig fields)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in exclude:
            continue
        if f.name == "lora_config":  # vLLM's five flags, not one (`add_lora_flags`)
            add_lora_flags(g)
            continue
        flag = "--" + f.name.replace("_", "-")
        help_ = _ENGINE_HELP.get(f.name, f.name.replace("_", " "))
        default = defaults.get(f.name, f.default)
        if str(f.type) == "bool":
            g.add_argument(flag, dest=f"engine_{f.name}", action=argparse.BooleanOptionalAction,
                           default=default, help=help_)
            continue
        shown = "" if default is None or "default" in help_ else f" (default: {default})"
        g.add_argument(flag, dest=f"engine_{f.name}", type=_engine_flag_type(f),
                       default=default, choices=_CHOICES.get(f.name),
                       metavar=None if f.name in _CHOICES else
                       _METAVARS.get(f.name, f.name.upper()),
                       help=help_ + shown)


def add_lora_flags(g: Any) -> None:
    """vLLM's LoRA flags (`lora_config.LoRAConfig`), dest `lora_<option>`."""
    g.add_argument("--enable-lora", dest="lora_enable_lora", action=argparse.BooleanOptionalAction,
                   default=False, help="serve LoRA adapters beside the base model: a request "
                   "names one as its model (docs/serving/lora.md)")
    g.add_argument("--lora-modules", dest="lora_lora_modules", nargs="+", metavar="NAME=PATH",
                   default=None, help="PEFT adapter directories registered at start-up, as "
                   "NAME=PATH (or vLLM's JSON '{\"name\": .., \"path\": ..}')")
    g.add_argument("--max-loras", dest="lora_max_loras", type=int, default=None,
                   metavar="N", help="adapters on the device at once (default: 1)")
    g.add_argument("--max-lora-rank", dest="lora_max_lora_rank", type=int, default=None,
                   metavar="R", help="largest adapter rank; every slot is padded to it "
                   "(default: 16)")
    g.add_argument("--max-cpu-loras", dest="lora_max_cpu_loras", type=int, default=None,
                   metavar="M", help="adapters kept loaded in host memory (default: "
                   "--max-loras)")
    g.add_argument("--lora-dtype", dest="lora_lora_dtype", default=None, choices=LORA_DTYPES,
                   help="the adapters' dtype on the device (default: auto, the model's, or "
                   "bfloat16 for a float32 model with quantized weights; bfloat16 halves "
                   "what a decode step reads for them)")


def engine_config_from_args(args: argparse.Namespace, **fixed: Any) -> EngineConfig:
    """The EngineConfig of `add_engine_flags`' flags; `fixed` gives the excluded fields."""
    values = {f.name: getattr(args, f"engine_{f.name}") for f in dataclasses.fields(EngineConfig)
              if hasattr(args, f"engine_{f.name}")}
    if hasattr(args, "lora_enable_lora") and "lora_config" not in fixed:
        values["lora_config"] = LoRAConfig.from_options(
            {name: getattr(args, f"lora_{name}") for name in LORA_OPTION_NAMES})
    return EngineConfig(**values, **fixed)


def add_sampling_flags(p: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None,
                       exclude: Sequence[str] = (), for_lines: bool = False) -> None:
    """One flag per SamplingParams field not in `exclude` (`--top-p`, `--stop` repeatable,
    `--ignore-eos/--no-ignore-eos`, ...), dest = the field name. `defaults` override
    SamplingParams' defaults for this command. `for_lines` (the batch job): every flag
    defaults to "not given", and a given one applies where an input line gives none."""
    defaults = dict(defaults or {})
    unknown = set(defaults) - set(sampling_params.BY_NAME)
    if unknown:
        raise ValueError(f"no sampling fields {sorted(unknown)}")
    title = "sampling (for lines that give none)" if for_lines else "sampling"
    g = p.add_argument_group(title)
    for f in sampling_params.FIELDS:
        if f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.default)
        shown = f"SamplingParams', {default}" if for_lines else default
        help_ = f.help if default is None or default == () else f"{f.help} (default: {shown})"
        if for_lines:
            default = None
        if f.type is bool:
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=default, help=help_)
        elif f.type is dict:  # `--logit-bias 5=-100` repeatable: (key, value) pairs
            g.add_argument(flag, dest=f.name, type=_pair(f.item), action="append",
                           default=None if default is None else list(default),
                           metavar="KEY=VALUE", help=f"{help_} (repeatable)")
        elif f in sampling_params.SPECS:  # `--structured-outputs '{"regex": "[0-9]+"}'`
            g.add_argument(flag, dest=f.name, type=_json_object, default=default,
                           metavar="JSON", help=f"{help_} (a JSON object)")
        elif f.type is tuple:
            g.add_argument(flag, dest=f.name, type=f.item, action="append",
                           default=None if default is None else list(default),
                           metavar=f.name.upper(), help=f"{help_} (repeatable)")
        else:
            g.add_argument(flag, dest=f.name, type=f.type, default=default,
                           metavar=f.name.upper(), help=help_)


def _json_object(text: str) -> dict[str, Any]:
    """argparse type of a spec field: a JSON object (SamplingParams checks its fields)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def _pair(value_type: type) -> Callable[[str], tuple[Any, Any]]:
    """argparse type of one `KEY=VALUE` entry of a mapping field (SamplingParams checks the
    key and value)."""
    def parse(text: str) -> tuple[Any, Any]:
        key, sep, value = text.partition("=")
        try:
            if not sep:
                raise ValueError(text)
            return sampling_params.token_key(key.strip()), value_type(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not KEY=VALUE with a {value_type.__name__} value") from None
    return parse


def sampling_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields the flags of `add_sampling_flags` hold (None: not given)."""
    out = {}
    for f in sampling_params.FIELDS:
        value = getattr(args, f.name, None)
        if value is not None:
            out[f.name] = tuple(value) if f.type in (tuple, dict) else value
    return out


def sampling_params_from_args(args: argparse.Namespace) -> sampling_params.SamplingParams:
    return sampling_params.SamplingParams(**sampling_kwargs_from_args(args))


def add_distributed_flags(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("several hosts (jax.distributed; see docs/scaling.md)")
    d.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address for jax.distributed; every process passes the "
                        "same value")
    d.add_argument("--num-processes", type=int, default=1,
                   help="processes (hosts) in the job (default 1)")
    d.add_argument("--process-id", type=int, default=0,
                   help="this process's index; 0 runs the scheduler (and any server or "
                        "output), the others run its steps on their devices (default 0)")


def join_or_follow(args: argparse.Namespace, cfg: EngineConfig) -> int | None:
    """With --num-processes > 1: join the jax.distributed job (before anything else touches a
    JAX backend); on a process > 0, build the same runner as process 0 and run its steps until
    it stops, returning the exit code. None: carry on (process 0, or a single process)."""
    dist = DistributedConfig(coordinator=args.coordinator, num_processes=args.num_processes,
                             process_id=args.process_id)
    if not dist.enabled:
        return None
    from jaxserve.device import multihost
    from jaxserve.serving.build import build_follower

    multihost.initialize(dist)
    if dist.is_leader:
        return None
    log.info("process %d of %d: following %s", dist.process_id, dist.num_processes,
             dist.coordinator)
    runner = build_follower(cfg)  # a multihost.Follower
    stats = multihost.follow(runner)
    log.info("process %d: the leader stopped; ran steps=%d rounds=%d keepalives=%d "
             "compiles_after_warmup=%d", dist.process_id, stats.steps, stats.rounds,
             stats.keepalives, runner.compiles_after_warmup)
    return 0
