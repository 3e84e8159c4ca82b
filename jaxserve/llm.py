"""Offline API shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Data flow: keyword arguments -> EngineConfig (validated; `speculative_config` as vLLM takes it:
a dict of its keys, or JSON text, or a `SpeculativeConfig`) -> `serving.build` (load, size,
place, compile: one Engine, or a ReplicaPool over `data_parallel_size` of them) -> `generate`
reads vLLM's prompt forms (`serving.prompt_forms`: a text, token ids, {"prompt": ...},
{"prompt_token_ids": [...]}) and admits every prompt (`Engine.admit`: the request checks
both servers run, same error text); `chat` builds each conversation as the chat fronts do
(`serving.chat`: tools checked and rendered, a forced call as the structured output) and
admits it (`admission.admit_input`), then reads each sample's text for tool calls. With
`enable_lora`, each prompt's `lora_request` (vLLM's `LoRARequest`) is registered and loaded
first (`_register`: a bad adapter raises before anything is queued). Both add
the requests to the engine (FINAL_ONLY outputs: one per request, when it finishes) and step
it until all are finished, returning RequestOutputs in input order.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Sequence

from tqdm.auto import tqdm

from jaxserve.config import EngineConfig, LoRAConfig, SpeculativeConfig
from jaxserve.engine.lora_request import LoRARequest
from jaxserve.lora_config import OPTION_NAMES as LORA_OPTION_NAMES
from jaxserve.engine.limits import Admitted, check_priority
from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.models.loading import LoadedModel
from jaxserve.serving import chat as chat_request
from jaxserve.serving import tool_prompt
from jaxserve.serving.admission import admit_input
from jaxserve.serving.build import build_engine
from jaxserve.serving.served import build_offline_engine
from jaxserve.serving.prompt_forms import Prompt, is_one_prompt, prompt_of


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
        if kwargs.get("speculative_config") is not None:
            kwargs["speculative_config"] = speculative_config_of(kwargs["speculative_config"])
        lora_options = {k: kwargs.pop(k) for k in LORA_OPTION_NAMES if k in kwargs}
        if lora_options:  # vLLM's keywords (enable_lora=True, max_loras=4, ...)
            if kwargs.get("lora_config") is not None:
                raise ValueError(f"give {sorted(lora_options)[0]} or lora_config, not both")
            kwargs["lora_config"] = LoRAConfig.from_options(lora_options)
        self.config = EngineConfig(model=model, **kwargs)  # type: ignore[arg-type]
        self.engine = build_offline_engine(self.config, loaded)
        self._ids = itertools.count()

    def scheduler_settings(self) -> dict[str, Any]:
        """The live scheduler settings (max_num_seqs, max_num_batched_tokens,
        decode_token_budget, ttft_slo, itl_slo, slo_admission, scheduling_policy), named as
        the flags, as the server's GET /admin/scheduler returns them."""
        return self.engine.scheduler_settings()

    def update_scheduler(self, **changes: Any) -> dict[str, Any]:
        """Change scheduler settings for the following `generate` calls, within what was
        compiled and allocated (ValueError naming the field and the limit otherwise; all or
        nothing), as the server's POST /admin/scheduler does; returns the new settings.
        slo_admission='reject' is refused, as at construction (`build_offline_engine`)."""
        if changes.get("slo_admission") == "reject":
            raise ValueError("slo_admission='reject' refuses requests as they arrive at a "
                             "server; the offline API queues every prompt at once: use "
                             "'queue'")
        return self.engine.update_scheduler(changes)

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
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (a text, token ids, or vLLM's {"prompt": text} /
        {"prompt_token_ids": ids}; another key, e.g. multi_modal_data, is a ValueError
        naming it); outputs in input order. `lora_request`: the adapter of every prompt, or
        one per prompt (None: the base model), as vLLM takes it (needs enable_lora=True).

        A request a failed engine step finished comes back like vLLM's: its samples have
        finish_reason ERROR and `error` (also on the RequestOutput) saying why; every other
        output is intact. Only a fatal failure (`EngineDead`: the device is lost) raises."""
        many = [prompts] if is_one_prompt(prompts) else list(prompts)  # type: ignore[arg-type]
        texts = [prompt_of(p, f"prompts[{i}]") for i, p in enumerate(many)]
        params, prio = self._per_prompt(len(texts), sampling_params, priority)
        loras = self._per_prompt_lora(len(texts), lora_request)
        # Every prompt through admission first: a bad one raises before any is queued.
        admitted = [self.engine.admit(p, sp) for p, sp in zip(texts, params)]
        self._register(loras)
        return self._run(self._submit(admitted, prio, loras), use_tqdm)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, *,
             chat_template: str | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             continue_final_message: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
             tool_choice: str | Mapping[str, Any] | None = None,
             parallel_tool_calls: bool | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template (or `chat_template`, with
        `chat_template_kwargs`), then generate, as /v1/chat/completions does: `tools` (OpenAI
        tool objects) are rendered with the messages; `tool_choice` "required" or a named
        function forces a call (a grammar), "auto" (the default with tools) lets the model
        choose. With tools, each sample's `tool_calls` and `content` hold its text read for
        calls in the model's format (OpenAI's shapes); `text` stays the raw text.
        `lora_request`: as `generate` takes it."""
        convs = [messages] if messages and isinstance(messages[0], Mapping) else \
            list(messages)  # type: ignore[arg-type]
        params, prio = self._per_prompt(len(convs), sampling_params, None)
        loras = self._per_prompt_lora(len(convs), lora_request)
        fmt = tool_prompt.resolve_format(tool_prompt.AUTO, self.tokenizer.chat_template)
        admitted = []
        request = None
        for conv, sp in zip(convs, params):
            inp, request = chat_request.chat_input(
                conv, tools_=tools, tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls,
                add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                continue_final_message=continue_final_message)
            admitted.append(admit_input(inp, chat_request.guided(sp, request),
                                        self.engine.limits, self.tokenizer, fmt))
        self._register(loras)
        outputs = self._run(self._submit(admitted, prio, loras), use_tqdm)
        for out in outputs:
            for c in out.outputs:
                read = chat_request.message_of(request, fmt, c.text)
                if read is not None:
                    c.content, c.tool_calls = read.content, list(read.tool_calls)
        return outputs

    @staticmethod
    def _per_prompt(n: int, sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                    priority: Sequence[int] | None
                    ) -> tuple[list[SamplingParams], list[int]]:
        """One SamplingParams and one priority (checked) per prompt."""
        if sampling_params is None:
            params: list[SamplingParams] = [SamplingParams()] * n
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * n
        else:
            params = list(sampling_params)
            if len(params) != n:
                raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
        prio = list(priority) if priority is not None else [0] * n
        if len(prio) != n:
            raise ValueError(f"got {len(prio)} priorities for {n} prompts")
        for p in prio:
            check_priority(p)
        return params, prio

    @staticmethod
    def _per_prompt_lora(n: int, lora_request: LoRARequest | Sequence[LoRARequest | None] | None
                         ) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt; a wrong type or count is a ValueError."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        if isinstance(lora_request, (str, bytes, Mapping)):
            raise ValueError("lora_request must be a LoRARequest or a list of them (one per "
                             f"prompt), got {type(lora_request).__name__}")
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} lora_requests for {n} prompts")
        for i, r in enumerate(loras):
            if r is not None and not isinstance(r, LoRARequest):
                raise ValueError(f"lora_request[{i}] must be a LoRARequest or None, got "
                                 f"{type(r).__name__}")
        return loras

    def _register(self, loras: list[LoRARequest | None]) -> None:
        """Register (and load) every adapter the engine has not seen, before any prompt is
        queued: a bad adapter, or a name registered with another id or path, raises with
        nothing queued (vLLM's offline rule: a LoRARequest registers itself)."""
        for r in dict.fromkeys(r for r in loras if r is not None):
            known = self.engine.resolve_lora(r.lora_name)
            if known is None:
                self.engine.add_lora(r)
            elif known != r:
                raise ValueError(f"lora_request {r.lora_name!r:.60} is registered with "
                                 f"lora_int_id={known.lora_int_id} and lora_path="
                                 f"{known.lora_path!r:.120}; give the same, or another name")

    def _submit(self, admitted: list[Admitted], prio: list[int],
                loras: list[LoRARequest | None]) -> list[str]:
        ids = [f"llm-{next(self._ids)}" for _ in admitted]
        for rid, req, pr, lora in zip(ids, admitted, prio, loras):
            # One output per request, at its end: nothing is copied per step.
            self.engine.add_request(rid, req, priority=pr,
                                    output_kind=RequestOutputKind.FINAL_ONLY,
                                    **({} if lora is None else {"lora_request": lora}))
        return ids

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


def speculative_config_of(value: object) -> SpeculativeConfig:
    """`LLM(speculative_config=...)`: a mapping of vLLM's keys (vLLM's way), the JSON text
    `--speculative-config` takes, or a SpeculativeConfig; anything else is refused by name."""
    if isinstance(value, SpeculativeConfig):
        return value
    try:
        if isinstance(value, Mapping):
            return SpeculativeConfig.from_dict(value)
        if isinstance(value, str):
            return SpeculativeConfig.from_json(value)
    except ValueError as e:
        raise ValueError(f"speculative_config: {e}") from None
    raise ValueError(f"speculative_config must be a dict of vLLM's keys (e.g. {{'method': "
                     f"'ngram', 'num_speculative_tokens': 5}}), JSON text or a "
                     f"SpeculativeConfig, got {type(value).__name__}")


__all__ = ["LLM", "SamplingParams", "build_engine"]
