"""Offline API shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Data flow: keyword arguments -> EngineConfig (validated) -> `build_engine` loads the model,
derives pages and buckets from free memory (`sizing.plan_engine`), creates the ModelRunner
(KV pages on device) and compiles every bucket -> `generate` adds every prompt to the Engine
and steps it until all are finished, returning RequestOutputs in input order.
"""

from __future__ import annotations

import itertools
import logging
from typing import Sequence

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from . import sharding
from .config import EngineConfig, RuntimeConfig, apply_runtime
from .engine import Engine
from .kernels_pallas import padded_head_dim, select_impl
from .model_runner import ModelRunner
from .models.loading import LoadedModel, load_model
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .sizing import available_host_memory, free_device_memory, plan_engine

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def build_engine(config: EngineConfig, model: LoadedModel | None = None,
                 warmup: bool = True, progress: bool = True) -> Engine:
    """Load (unless given), size, place and compile: a ready-to-step Engine."""
    if config.compilation_cache_dir:
        apply_runtime(RuntimeConfig(compilation_cache_dir=config.compilation_cache_dir))
    model = model or load_model(config.model, config.dtype)
    device = jax.local_devices()[0]
    mesh, run_cfg, params = None, model.config, model.params
    if config.tensor_parallel_size > 1:
        mesh = sharding.make_tp_mesh(config.tensor_parallel_size)
        run_cfg = sharding.tp_model_config(model.config, config.tensor_parallel_size)
        params = sharding.shard_params(model.params, model.config, mesh)
    attn_impl = select_impl(config.attention_impl)
    kv_dtype = _DTYPES[config.kv_cache_dtype or config.dtype]
    # Pallas kernels want lane-aligned head dims; the jnp reference takes any.
    kv_head_dim = None if attn_impl == "reference" else padded_head_dim(model.config.head_dim)
    free = free_device_memory(device)
    # Under tensor parallelism the KV budget is still one device's free memory for all the
    # pages: conservative (each device holds 1 / tp of them, or 1 / num_kv_heads when KV
    # heads are replicated), and right on CPU where the virtual devices share host memory.
    plan = plan_engine(config, run_cfg, jnp.dtype(kv_dtype).itemsize,
                       free if free is not None else available_host_memory(), kv_head_dim)
    log.info("KV cache: %d pages of %d tokens (%.1f MiB), attention=%s",
             plan.scheduler.num_pages - 1, plan.scheduler.page_size,
             plan.kv_budget_bytes / 2**20, attn_impl)
    runner = ModelRunner(run_cfg, params, plan.batch_shape, plan.scheduler.num_pages,
                         kv_dtype, attn_impl, kv_head_dim, mesh)
    if warmup:
        runner.warmup(progress)
    return Engine(config, plan, runner, model.tokenizer, model.config.eos_token_ids)


class LLM:
    """Offline batch generation. Keyword arguments are EngineConfig fields."""

    def __init__(self, model: str | None = None, **kwargs: object):
        self.config = EngineConfig(model=model, **kwargs)  # type: ignore[arg-type]
        self.engine = build_engine(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201 - jaxserve.models.tokenizer.Tokenizer
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            params: list[SamplingParams] = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        prio = list(priority) if priority is not None else [0] * len(prompts)
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, p, sp, pr in zip(ids, prompts, params, prio):
                self.engine.add_request(rid, p, sp, priority=pr)
                added.append(rid)
        except ValueError:
            for rid in added:  # leave the engine as we found it
                self.engine.abort(rid)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt,
                                                      tokenize=True) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            toks = 0
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    toks += sum(len(c.delta_token_ids) for c in out.outputs)
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
                bar.set_postfix(tok_s=f"{toks / max(bar.format_dict['elapsed'], 1e-9):.1f}")
        return [final[i] for i in ids]


__all__ = ["LLM", "SamplingParams", "build_engine"]
