"""The engine: add_request / abort / step. No threads; the caller drives steps.

Data flow of `step()`: the step driver runs one step (`step_core.StepCore`: schedule ->
build -> run -> apply, synchronous; or, with `EngineConfig.async_scheduling` (on by default),
`pipeline.Pipeline` around it: the next step is dispatched while the previous one runs on the
device) and leaves the groups with news in the core's `news`; `step()` takes them (with the
aborts since the last step) and turns each into a RequestOutput shaped by its request's
`RequestOutputKind` (cumulative copies, deltas only, or nothing until the final one; see
`outputs.py`). Each `step()` returns the outputs of the step it applied.

The engine owns the requests' host-side extras (prompt text, detokenizers, n-sample groups,
grammar matchers); the scheduler owns their KV state; the runner owns everything on the
device. Callers outside read `limits` (what a request must fit in) and `stats()` (a snapshot
of the counters), never the scheduler or allocator. `admit()` runs every request check
(`limits.EngineLimits`, the grammar compile) without queueing; `add_request` runs it unless
handed the `Admitted` result.

Identity: the client's request id names a group (one per user request, the duplicate check
is on it whatever `n` is); each of its n sequences gets an integer `seq_id` from the
scheduler, the only key below this class. A request is queued whole or not at all.

LoRA (`config.lora_config`): the engine owns the adapter registry and host cache
(`lora_registry.LoraRegistry`, loading through the injected `lora_loader`), the scheduler the
device slot table (`lora_slots.LoraSlots`); a request's `LoRARequest` is bound to its
registration (`Sequence.lora`), and `add_lora` / `remove_lora` / `list_loras` /
`resolve_lora` serve the fronts' runtime load, unload and model listing.

When a step fails, the requests it cost finish with FinishReason.ERROR and the engine carries
on, unless the device or host state is unknown: then `EngineDead`, raised by that and every
later `step` / `add_request`. Which failure costs what, and how: `recovery.py`; the
stages return what they failed as values (`step_core.py`).
"""

from __future__ import annotations

import functools
import random
import time
from typing import Any, Callable, Mapping, Sequence as GenericSequence

from jaxserve.config import EngineConfig
from jaxserve.engine.errors import EngineDead, InvalidRequest, SloUnattainable
from jaxserve.engine.batch import empty_batch
from jaxserve.engine.grammar import grammar_compiler
from jaxserve.engine.group import Group
from jaxserve.engine.limits import (Admitted, EngineLimits, EngineStats, check_not_in_flight,
                                    check_priority, check_request_id)
from jaxserve.engine.live_settings import LiveBounds, check_changes, settings_of
from jaxserve.engine.lora_registry import LoraLoader, engine_registry, lora_on
from jaxserve.engine.lora_request import LoRARequest
from jaxserve.engine.lora_stats import LoraCounters
from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
from jaxserve.engine.pipeline import Pipeline
from jaxserve.engine.recovery import Recovery
from jaxserve.engine.sequence import Sequence, SequenceStatus
from jaxserve.engine.runner import Runner
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sizing import EnginePlan
from jaxserve.engine.spec_ngram import NgramProposer
from jaxserve.engine.speculation import OnTokens, Proposer, Speculator
from jaxserve.engine.step_core import InFlight, StepCore
from jaxserve.engine.step_time_model import StepFeatures
from jaxserve.models.tokenizer import Tokenizer


class Engine:
    def __init__(self, config: EngineConfig, plan: EnginePlan, runner: Runner,
                 tokenizer: Tokenizer, eos_token_ids: GenericSequence[int],
                 clock: Callable[[], float] = time.monotonic,
                 proposer: Proposer | None = None, lora_loader: LoraLoader | None = None):
        """`proposer`: what proposes tokens for a `speculative_config` whose method needs a
        model on the device (draft_model, eagle3: built with the runner by serving.build);
        n-gram's is built here. `lora_loader`: `load(lora_path) -> adapter` (what
        `runner.load_lora` takes), required with a `lora_config` and refused without."""
        self.config = config
        self.plan = plan
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.clock = clock
        lora = config.lora_config
        self.scheduler = Scheduler(plan.scheduler, clock, plan.batch_shape.buckets,
                                   max_loras=lora.max_loras if lora is not None else 0)
        self._loras = engine_registry(lora, lora_loader, self.scheduler.lora)
        self._lora_counts = LoraCounters(lora.max_loras if lora is not None else 0)
        self._groups: dict[str, Group] = {}
        self._seed_rng = random.Random(config.seed)
        sc = plan.scheduler
        self._live_bounds = LiveBounds.of(plan)
        self._limits = EngineLimits(
            max_model_len=sc.max_model_len, vocab_size=plan.batch_shape.vocab_size,
            page_size=sc.page_size, num_kv_pages=sc.num_pages - 1,
            max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
            max_step_tokens=self._live_bounds.max_step_tokens,
            kv_windows=sc.kv_windows, eos_token_ids=self.eos_token_ids,
            max_token_bytes=tokenizer.max_token_bytes,
            grammars=grammar_compiler(tokenizer, plan.batch_shape.vocab_size),
            encode_words=functools.partial(tokenizer.encode, add_special_tokens=False))
        # What a failed step costs; it alone keeps why the engine is dead.
        self._recovery = Recovery(self.scheduler, self._group_of)
        self._core = StepCore(self.scheduler, runner, plan.batch_shape, self._recovery,
                              self._group_of,
                              speculator(config, plan, proposer, self.scheduler),
                              lora_adapter=self._loras.adapter if self._loras else None)
        self._steps: StepCore | Pipeline = \
            Pipeline(self._core) if config.async_scheduling else self._core

    @property
    def runner(self) -> Runner:
        return self._core.runner

    @runner.setter
    def runner(self, runner: Runner) -> None:  # a wrapper (benchmarks watch the steps)
        self._core.runner = runner

    @property
    def num_steps(self) -> int:
        return self._core.num_steps

    @property
    def last_step_tokens(self) -> int:
        return self._core.last_step_tokens

    @property
    def _in_flight(self) -> InFlight | None:
        """The step on the device whose results are not applied yet (None: none)."""
        return self._steps.in_flight

    # ----------------------------------------------------------------------- read-only views
    @property
    def limits(self) -> EngineLimits:
        """What a request must fit in (and what callers are told about the model)."""
        return self._limits

    def stats(self) -> EngineStats:
        """A snapshot of the running state and cumulative counters (call it from the thread
        that drives the engine)."""
        sched = self.scheduler
        alloc = sched.allocator
        total = alloc.num_usable_pages
        return EngineStats(
            num_requests=len(self._groups), num_running=sched.num_running,
            num_waiting=sched.num_waiting, kv_pages_used=total - alloc.num_free_pages,
            kv_pages_total=total, prefix_cache_queries=alloc.prefix_queries * alloc.page_size,
            prefix_cache_hits=alloc.prefix_hits * alloc.page_size,
            num_preemptions=sched.num_preemptions, num_steps=self.num_steps,
            last_step_tokens=self.last_step_tokens,
            compiles_after_warmup=self.runner.compiles_after_warmup,
            slo=sched.budget.stats(), lora=self._lora_counts.stats(
                sched.running, (s for _, _, s in sched.waiting_heap
                                if s.status is SequenceStatus.WAITING)),
            **self._spec_stats())

    def _spec_stats(self) -> dict:
        spec = self._core.speculator
        if spec is None:
            return {}
        return dict(spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
                    spec_num_accepted_tokens=spec.num_accepted_tokens,
                    spec_acceptance_counts=tuple(spec.acceptance_counts))

    # ----------------------------------------------------------------------- intake
    def admit(self, prompt: str | GenericSequence[int], params: SamplingParams | None = None
              ) -> Admitted:
        """Every check of one request (its limits, its grammar's compile), without queueing
        it (thread-safe: it reads only the limits and the tokenizer)."""
        return self._limits.admit(prompt, params or SamplingParams(), self._encode)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def add_request(self, request_id: str, prompt: str | GenericSequence[int] | Admitted,
                    params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request; ValueError (an InvalidRequest naming the field) for anything that
        cannot run. An `Admitted` prompt (from `admit`) carries its params and is not checked
        again. Every check runs before anything is queued. `output_kind`: what its outputs
        carry (see `outputs.RequestOutputKind`). `lora_request`: the adapter it runs under
        (vLLM's offline rule: one the engine does not know is registered and loaded now; a
        known name with another path or id is refused, naming lora_name)."""
        self._recovery.check_alive()
        check_request_id(request_id)
        check_not_in_flight(request_id, self._groups)
        check_priority(priority)
        if priority != 0 and self.scheduler.cfg.scheduling_policy == "fcfs":
            raise InvalidRequest(f"priority={priority} must be 0: the scheduling policy is "
                                 "fcfs (arrival order; --scheduling-policy priority, or the "
                                 "admin endpoint, allows priorities)", "priority")
        req = prompt if isinstance(prompt, Admitted) else self.admit(prompt, params)
        params, ids = req.params, list(req.token_ids)
        self._check_ttft(len(ids), priority)
        lora = None if lora_request is None else \
            lora_on(self._loras, lora_request).bind(lora_request)
        if lora is not None:
            self._lora_counts.on_request(lora.name)
        now = self.clock() if arrival_time is None else arrival_time
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        grammars = self._limits.grammars  # one matcher per sample, of the admitted grammar
        seqs = [Sequence(request_id, list(ids), params, self.eos_token_ids, now,
                        priority=priority, sample_index=i, max_tokens=req.max_tokens,
                        seed=(base_seed + i) % (1 << 64), grammar=None if req.grammar is None
                        else grammars.matcher(req.grammar),  # type: ignore[union-attr]
                        token_filter=req.token_filter, lora=lora)
                for i in range(params.n)]
        group = Group.create(request_id, req.prompt, ids, params, seqs, self.tokenizer.backend,
                             output_kind)
        for i, seq in enumerate(seqs):  # cannot fail: checked, and fresh sequences
            self.scheduler.add_request(seq, fork_of=seqs[0] if i else None, checked=True)
        self._groups[request_id] = group

    def _check_ttft(self, num_prompt_tokens: int, priority: int) -> None:
        """Count (and with slo_admission="reject", refuse) a request whose predicted time to
        first token already passes its level's TTFT target."""
        sched = self.scheduler
        cfg = sched.cfg
        target = cfg.ttft_slo.for_priority(priority) if cfg.ttft_slo is not None else None
        if target is None:
            return
        predicted = sched.budget.predict_ttft(num_prompt_tokens, priority, sched.running,
                                              sched.waiting_heap)
        if predicted <= target:
            return
        sched.budget.count_unattainable(priority)
        if cfg.slo_admission == "reject":
            raise SloUnattainable(predicted, target, priority)

    def abort(self, request_id: str) -> bool:
        """Abort a request at any moment; its final output (ABORT) comes from the next step."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        self.scheduler.abort([s.seq_id for s in group.seqs])
        self._core.touch([group])  # its final ABORT output comes from the next step
        return True

    # ----------------------------------------------------------------------- LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Register an adapter and load it now (runtime load; InvalidRequest naming
        lora_name / lora_int_id / lora_path when it cannot be; the engine's thread)."""
        lora_on(self._loras, lora_request).add(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Unregister an adapter (False: no such name). Requests already queued with it
        finish normally; its device slot frees once they are done (the engine's thread)."""
        binding = self._loras.remove(lora_name) if self._loras is not None else None
        if binding is not None:
            self.scheduler.lora.forget(binding.load_id)
        return binding is not None

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters (for /v1/models), in registration order."""
        return self._loras.list() if self._loras is not None else []

    def resolve_lora(self, lora_name: str) -> LoRARequest | None:
        """The registered adapter of that name (None: none; any thread: one dict read)."""
        binding = self._loras.resolve(lora_name) if self._loras is not None else None
        return binding.request if binding is not None else None

    # ----------------------------------------------------------------------- live settings
    def scheduler_settings(self) -> dict[str, Any]:
        """The live scheduler settings (`live_settings.settings_of`: JSON values named as
        the flags). Safe from any thread: one read of the frozen config the scheduler holds."""
        return settings_of(self.scheduler.cfg)

    def check_scheduler_update(self, changes: Mapping[str, Any]) -> None:
        """Raise InvalidRequest (naming the field and the limit) if `changes` cannot apply
        now; changes nothing (any thread: it reads the frozen config once)."""
        check_changes(self.scheduler.cfg, changes, self._live_bounds)

    def update_scheduler(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Apply `changes` ({field: value} of `LIVE_SCHEDULER_FIELDS`) from the next step
        on, all or none (every value is checked first: InvalidRequest naming the field and
        the limit); returns the new settings. Call it between steps, from the thread that
        drives the engine. Requests in flight keep running (`live_settings.py`)."""
        self.scheduler.cfg = check_changes(self.scheduler.cfg, changes, self._live_bounds)
        return settings_of(self.scheduler.cfg)

    def warmup_proposer(self) -> None:
        """Compile a device proposer's rounds (a draft model's), if it has any to compile;
        `serving.build.warm_up` calls it before arming the compile guard."""
        spec = self._core.speculator
        warmup = getattr(spec.proposer, "warmup", None) if spec is not None else None
        if warmup is not None:
            warmup()

    def calibrate_step_time(self, force: bool = False) -> None:
        """Seed the step-time model (`step_time_model.py`) with timed all-padding steps of a
        few compiled buckets (the smallest, the largest and two between; each run twice, the
        faster kept: the first run of an executable may pay for loading it), so the SLO
        policy's first decisions rest on this machine's speed. Only with SLO targets set
        (unless `force`): it costs the largest bucket's step twice at start-up; without
        targets the model learns from the served steps alone. Call it after warmup, before
        serving (`serving.build.warm_up` does)."""
        if not (force or self.scheduler.cfg.slo_enabled):
            return
        shape = self.plan.batch_shape
        buckets = shape.buckets
        picks = sorted({buckets[i] for i in (0, len(buckets) // 3, 2 * len(buckets) // 3,
                                             len(buckets) - 1)})
        samples = []
        for tokens, seqs in picks:
            batch = empty_batch(shape, tokens, seqs, penalties=False)
            times = []
            for _ in range(2):
                start = self.clock()
                self.runner.execute(batch)
                times.append(self.clock() - start)
            samples.append((StepFeatures(tokens, seqs, 0), min(times)))
        self.scheduler.budget.model.seed(samples)

    def has_unfinished(self) -> bool:
        return bool(self._groups) or self._in_flight is not None

    def close(self) -> None:
        """Release the runner (multi-host: the other processes stop following)."""
        self.runner.close()

    @property
    def num_requests(self) -> int:
        return len(self._groups)

    @property
    def dead(self) -> str | None:
        """Why the engine cannot step any more (None: it can)."""
        return self._recovery.dead

    # ----------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; outputs for every request with news. A failure of
        some requests finishes them with ERROR (see `recovery.py`); EngineDead when the
        engine cannot go on."""
        recovery = self._recovery
        recovery.check_alive()
        try:
            self._steps.step()
        except EngineDead:
            raise
        except Exception as e:  # noqa: BLE001 - a failed recovery: state unknown
            raise recovery.die("recovering from a failed step failed", e) from e
        outputs = []
        for g in self._core.take_news().values():
            output = self._output(g)
            if output is not None:
                outputs.append(output)
            if g.seqs[0].lora is not None:  # per-adapter generated tokens
                self._lora_counts.on_tokens(g.seqs, g.done_reported)
            if g.done_reported:
                del self._groups[g.request_id]
                for seq in g.seqs:  # SLO attainment, per priority level
                    self.scheduler.budget.record_finished(self.scheduler.cfg, seq)
        return outputs

    def _output(self, g: Group) -> RequestOutput | None:
        """The group's output (None: nothing to report); a failure costs this request only."""
        try:
            return g.output()
        except Exception as e:  # noqa: BLE001 - this request's output only
            message = f"building the output failed: {e!r}"
        try:
            return self._recovery.error_output(g, message)
        except Exception as e2:  # noqa: BLE001 - a failed recovery: state unknown
            raise self._recovery.die("recovering from a failed output failed", e2) from e2

    def _group_of(self, req: Sequence) -> Group | None:
        group = self._groups.get(req.request_id)
        return group if group is not None and group.holds(req) else None


def speculator(config: EngineConfig, plan: EnginePlan, proposer: Proposer | None,
               scheduler: Scheduler) -> Speculator | None:
    """The engine's speculative decoding (None without a speculative_config). A proposer's
    lookahead pages (a draft model's chain) are held through `KVManager.reserve`, capped
    at max_model_len tokens (no position past it is ever verified)."""
    spec = config.speculative_config
    if spec is None:
        if proposer is not None:
            raise ValueError("a proposer was given but the config has no speculative_config")
        return None
    if proposer is None:
        if spec.method != "ngram":
            raise ValueError(f"speculative_config method {spec.method!r} needs its proposer "
                             "(built with the runner by jaxserve.serving.build)")
        proposer = OnTokens(NgramProposer.from_config(spec, plan.scheduler.max_model_len))
    max_len = plan.scheduler.max_model_len
    scheduler.budget.expect_proposals(spec.num_speculative_tokens)

    def reserve(seq: Sequence, num_tokens: int) -> bool:
        return scheduler.kv.reserve(seq, min(num_tokens, max_len))

    return Speculator(proposer, spec.num_speculative_tokens, plan.speculative_max_running,
                      reserve)
