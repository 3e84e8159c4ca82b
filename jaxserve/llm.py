"""Offline API shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Data flow: keyword arguments -> EngineConfig (validated) -> `serving.build` (load, size,
place, compile: one Engine, or a ReplicaPool over `data_parallel_size` of them) -> `generate`
admits every prompt (`Engine.admit`: the request checks both servers run, same error text),
adds them to the engine (FINAL_ONLY outputs: one per request, when it finishes) and steps it
until all are finished, returning RequestOutputs in input order.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.engine.limits import check_priority
from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.models.loading import LoadedModel
from jaxserve.serving.admission import render_chat
from jaxserve.serving.build import build_engine, build_offline_engine

Prompt = str | Sequence[int]


class LLM:
    """Offline batch generation. Keyword arguments are EngineConfig fields."""

    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None,
                 **kwargs: object):
        """`model`: a path (None: the bundled model). `loaded`: weights already in memory
        instead (a `LoadedModel`: config, params, tokenizer; e.g. a researcher's JAX
        checkpoint, or random weights for a benchmark), stored as `quantization` says (default
        "auto": as they are)."""
        if loaded is not None and model is not None:
            raise ValueError(f"give model={model!r} or loaded=..., not both")
        self.config = EngineConfig(model=model, **kwargs)  # type: ignore[arg-type]
        self.engine = build_offline_engine(self.config, loaded)
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine (several hosts: the other processes stop following)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):  # noqa: ANN201 - jaxserve.models.tokenizer.Tokenizer
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in input order.

        A request a failed engine step finished comes back like vLLM's: its samples have
        finish_reason ERROR and `error` (also on the RequestOutput) saying why; every other
        output is intact. Only a fatal failure (`EngineDead`: the device is lost) raises."""
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
        if len(prio) != len(prompts):
            raise ValueError(f"got {len(prio)} priorities for {len(prompts)} prompts")
        # Every prompt through admission first: a bad one raises before any is queued.
        for p in prio:
            check_priority(p)
        admitted = [self.engine.admit(p, sp) for p, sp in zip(prompts, params)]
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for rid, req, pr in zip(ids, admitted, prio):
            # One output per request, at its end: nothing is copied per step.
            self.engine.add_request(rid, req, priority=pr,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
        return self._run(ids, use_tqdm)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [render_chat(c, self.tokenizer, add_generation_prompt, self.engine.limits)
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            toks = 0
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        toks += sum(c.num_tokens for c in out.outputs)
                        final[out.request_id] = out
                        bar.update(1)
                bar.set_postfix(tok_s=f"{toks / max(bar.format_dict['elapsed'], 1e-9):.1f}")
        return [final[i] for i in ids]


__all__ = ["LLM", "SamplingParams", "build_engine"]
