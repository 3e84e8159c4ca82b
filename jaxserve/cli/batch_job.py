"""`jaxserve batch IN.jsonl OUT.jsonl`: offline batch inference over a JSONL file.

Input: one JSON object per line:
    {"id": "q1", "prompt": "text" | [token ids], ...sampling}   or
    {"id": "q2", "messages": [{"role": "user", "content": "..."}], ...sampling}
and optionally "model": a LoRA adapter's name (--enable-lora --lora-modules NAME=PATH) or the
base model's (the --model value; absent: the base model), as vLLM's batch lines name one;
sampling keys are `jaxserve.SamplingParams` fields ("max_tokens": 64, "temperature": 0.7,
"stop": [...], "n": 2, ...). The sampling flags (--max-tokens, --temperature, ...; one per
field but "seed", as --seed is the engine's) apply where a line gives none; keys absent from
both take SamplingParams' defaults. Blank lines are ignored.

Output: one line per input line, in input order:
    {"id", "text", "prompt_tokens", "completion_tokens", "finish_reason", "cached_prompt_tokens"}
and, when the engine speculates (--speculative-config), "spec_num_draft_tokens" and
"spec_num_accepted_tokens": tokens proposed for the request and those accepted (over its
samples).
With n > 1, "text" and "finish_reason" are lists (one entry per sample, in sample order) and
"completion_tokens" is the total over the samples. With "logprobs": k, "logprobs" (per token
{token_id: logprob}; a list of those per sample when n > 1) is added; with
"prompt_logprobs": k, "prompt_logprobs" (per prompt token null for the first, else
{token_id: logprob} holding the prompt token first, then the top k). A line that cannot run
becomes {"id": ..., "error": "..."} in its place ("id": null and "line": N without a usable id);
a bad line never stops the job. An id seen earlier in IN gives a "duplicate id" error line.
A request a failed engine step finished (finish reason "error") becomes an error line too
(the engine's text); only a fatal engine failure (a lost device) stops the job.

Data flow:
  IN --read_lines--> windows of --window lines --batch_io.parse_line--> LineRequest | LineError
  -> skip what OUT already holds (resume) -> `admit_line` (chat template for messages, then
  the engine's admission: tokenization and every request check; the line's "model" resolved
  to its adapter; a refusal, e.g. a prompt too long for max_model_len or a model name that is
  neither the base model nor a --lora-modules adapter, becomes an error line) -> sort the window's requests by prompt
  length, longest first -> engine.add_request (FINAL_ONLY: one output per request, at
  its end) -> engine.step() until finished
  -> result records -> OrderedSink (buffers finished results, writes the contiguous prefix in
  input order) -> ResultWriter (one whole line per write; fsync at intervals and at the end).

The next window is read as soon as fewer than max_num_seqs requests are left in the engine, so
the engine never drains between windows; reading pauses while more than a window of lines is
held back behind an unfinished earlier line, so memory stays bounded by about two windows.

Resume: rerunning with the same OUT skips every id (and id-less error line) OUT already holds,
error records included: a line that failed validation fails again the same way. --retry-errors
removes the error records from OUT first, so those lines run again. A partial last line left
by a crash is cut off and redone. On resume the new records are appended after the old ones.

Several hosts (a model split over the chips of several hosts): run the same command on each
with --coordinator / --num-processes / --process-id; process 0 reads IN and writes OUT, the
others only run its steps on their devices (`jaxserve.device.multihost`).

Exit status: 0 when the job ran (even with error lines); 2 for unusable arguments.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import pathlib
import sys
import time
from typing import Any, Sequence

from jaxserve.cli import flags
from jaxserve.cli.batch_io import (LineError, LineRequest, OrderedSink, ResultWriter, ResumeState,
                                   count_lines, id_key, parse_line, read_lines, recover_output)
from jaxserve.engine.limits import Admitted
from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.serving.admission import render_chat
from jaxserve.serving.lora_requests import LoraNotFound, resolve_model

log = logging.getLogger("jaxserve.batch")

DEFAULT_WINDOW = 1024


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    window: int = DEFAULT_WINDOW  # input lines read, sorted and queued at a time
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # SamplingParams fields
    retry_errors: bool = False
    fsync_interval: float = 5.0  # seconds between fsyncs of OUT (and one at the end)
    progress: bool = True
    model_names: tuple[str, ...] = ()  # what a line's "model" may call the base model

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window={self.window!r} must be a positive integer")
        if self.fsync_interval < 0:
            raise ValueError(f"fsync_interval={self.fsync_interval} must be >= 0")
        SamplingParams(**self.defaults)  # a bad default is an argument error, not N error lines


@dataclasses.dataclass
class BatchSummary:
    lines: int = 0  # non-blank input lines
    ok: int = 0
    errors: int = 0
    skipped: int = 0  # already in OUT (resume)
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def format(self) -> str:
        return (f"batch: {self.lines} lines: {self.ok} ok, {self.errors} errors, "
                f"{self.skipped} skipped (already in OUT); {self.output_tokens} output tokens "
                f"in {self.wall_s:.1f}s ({self.tokens_per_s:.1f} tok/s)")


def admit_line(req: LineRequest, engine: Any) -> Admitted:
    """The line's request through the engine's admission (chat template for messages, every
    request check); InvalidRequest (a ValueError) naming the field when it cannot run."""
    if req.messages is not None:
        return engine.admit(render_chat(req.messages, engine.tokenizer, True, engine.limits),
                            req.params)
    return engine.admit(req.prompt if req.prompt is not None else [], req.params)


def line_lora(req: LineRequest, engine: Any, model_names: tuple[str, ...]) -> Any:
    """The LoRARequest a line's "model" names (None: the base model); ValueError naming the
    model when it is neither the base model nor a registered adapter."""
    try:
        return resolve_model(engine, req.model, model_names)
    except LoraNotFound:
        adapters = [r.lora_name for r in engine.list_loras()] \
            if engine.config.lora_config is not None else []
        known = ", ".join(map(repr, adapters)) or "none: --enable-lora --lora-modules NAME=PATH"
        raise ValueError(f"model {req.model!r:.80} is neither the base model "
                         f"({', '.join(map(repr, model_names))}) nor a LoRA adapter "
                         f"({known})") from None


def result_record(rid: Any, out: RequestOutput, params: SamplingParams,
                  speculative: bool = False) -> dict[str, Any]:
    """One output line; `speculative` (the engine speculates) adds the draft / accepted token
    counts, summed over the samples (0 for a request that opted out)."""
    comps = sorted(out.outputs, key=lambda c: c.index)
    reasons = [c.finish_reason.value if c.finish_reason is not None else None for c in comps]
    rec: dict[str, Any] = {
        "id": rid,
        "text": comps[0].text if params.n == 1 else [c.text for c in comps],
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": sum(c.num_tokens for c in comps),
        "finish_reason": reasons[0] if params.n == 1 else reasons,
        "cached_prompt_tokens": out.num_cached_tokens,
    }
    if speculative:
        metrics = [c.metrics for c in comps if c.metrics is not None]
        rec["spec_num_draft_tokens"] = sum(m.spec_num_draft_tokens for m in metrics)
        rec["spec_num_accepted_tokens"] = sum(m.spec_num_accepted_tokens for m in metrics)
    if params.logprobs is not None:
        lps = [c.logprobs or [] for c in comps]
        rec["logprobs"] = lps[0] if params.n == 1 else lps
    if params.prompt_logprobs is not None:  # one per prompt token, null for the first
        rec["prompt_logprobs"] = out.prompt_logprobs
    return rec


class _Progress:
    """tqdm over input lines, with ok / error counts and output tokens/s."""

    def __init__(self, total: int | None, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="batch", unit="line", disable=not enabled,
                        dynamic_ncols=True)
        self.t0 = time.perf_counter()

    def update(self) -> None:
        self.bar.update(1)

    def postfix(self, s: BatchSummary, tokens: int) -> None:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix(ok=s.ok, err=s.errors, tok_s=f"{tokens / dt:.0f}", refresh=False)

    def close(self) -> None:
        self.bar.close()


def run_batch(engine: Any, in_path: pathlib.Path, out_path: pathlib.Path,
              options: BatchOptions | None = None) -> BatchSummary:
    """Run every line of IN through `engine` (an Engine or a ReplicaPool), appending results to
    OUT in input order; resumes from what OUT already holds. Returns the counts."""
    opts = options or BatchOptions()
    t0 = time.perf_counter()
    state: ResumeState = recover_output(out_path, retry_errors=opts.retry_errors)
    summary = BatchSummary()
    seen: collections.Counter[str] = collections.Counter()  # id -> lines with it so far
    inflight: dict[str, tuple[int, Any, SamplingParams]] = {}  # engine id -> line, id, params
    # Keep every replica's batch full (data parallel: each replica runs max_num_seqs).
    low_water = engine.config.max_num_seqs * engine.config.data_parallel_size
    speculative = engine.config.speculative_config is not None
    lines = read_lines(in_path)
    last_line = 0  # last line read
    live_tokens = 0
    progress = _Progress(count_lines(in_path), opts.progress)

    def resolve(line: int, record: dict[str, Any] | None) -> None:
        sink.put(line, record)
        progress.update()

    def read_window() -> bool:
        """Read, validate and queue up to one window of lines; False at the end of IN."""
        nonlocal last_line
        queued: list[tuple[int, LineRequest, Admitted, Any]] = []
        more = True
        for _ in range(opts.window):
            item = next(lines, None)
            if item is None:
                more = False
                break
            line, text, decode_error = item
            last_line = line
            if text is not None and not text.strip():
                resolve(line, None)  # blank line
                continue
            summary.lines += 1
            parsed = (LineError(line, None, decode_error) if text is None
                      else parse_line(text, line, opts.defaults))
            if parsed.id is None:  # no usable id: resume knows it by its line number
                if line in state.done_lines:
                    summary.skipped += 1
                    resolve(line, None)
                else:
                    summary.errors += 1
                    assert isinstance(parsed, LineError)
                    resolve(line, parsed.record())
                continue
            seen[id_key(parsed.id)] += 1
            occurrence = seen[id_key(parsed.id)]
            if state.occurrence_done(parsed.id, occurrence):
                summary.skipped += 1
                resolve(line, None)
                continue
            if occurrence > 1:
                parsed = LineError(line, parsed.id, f"duplicate id {parsed.id!r}: it first "
                                                     "appears on an earlier line")
            if isinstance(parsed, LineRequest):
                try:
                    lora = line_lora(parsed, engine, opts.model_names)
                    queued.append((line, parsed, admit_line(parsed, engine), lora))
                    continue
                except ValueError as e:
                    parsed = LineError(line, parsed.id, str(e))
            summary.errors += 1
            resolve(line, parsed.record())
        # Longest prompt first (a stable sort: ties keep input order). Prompt length is the
        # work we know up front; starting the long requests first (the LPT rule) lets the short
        # ones fill the seats they free, so the batch stays full until the window's end instead
        # of ending on a few long stragglers; and a prompt that cannot fit fails at once.
        queued.sort(key=lambda q: -len(q[2].token_ids))
        for line, req, admitted, lora in queued:
            rid = f"batch-{line}"
            # Checked by admit_line; one output per request, at its end (FINAL_ONLY).
            engine.add_request(rid, admitted, output_kind=RequestOutputKind.FINAL_ONLY,
                               lora_request=lora)
            summary.prompt_tokens += len(admitted.token_ids)
            inflight[rid] = (line, req.id, req.params)
        return more

    writer = ResultWriter(out_path, opts.fsync_interval)
    sink = OrderedSink(writer)
    try:
        more = True
        while True:
            # Refill before the batch runs short; pause while more than a window of lines is
            # held back behind an unfinished earlier one (bounded memory).
            while more and engine.num_requests < low_water and \
                    last_line - (sink.next_line - 1) <= opts.window:
                more = read_window()
            if not engine.has_unfinished():
                if not more:
                    break
                continue  # everything read so far is written: read on
            for out in engine.step():
                if not out.finished:
                    continue  # (FINAL_ONLY: every output is a request's last)
                live_tokens += out.num_delta_tokens
                line, rid, params = inflight.pop(out.request_id)
                if out.error is not None:  # a failed step: an error line (--retry-errors)
                    summary.errors += 1
                    resolve(line, LineError(line, rid, out.error).record())
                    continue
                rec = result_record(rid, out, params, speculative)
                summary.ok += 1
                summary.output_tokens += rec["completion_tokens"]
                resolve(line, rec)
            progress.postfix(summary, live_tokens)
    finally:
        writer.close()
        progress.close()
    summary.wall_s = time.perf_counter() - t0
    return summary


# ----------------------------------------------------------------------------- command line
def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="IN", help="input JSONL: one request per line")
    p.add_argument("output", metavar="OUT",
                   help="output JSONL (appended to; ids already in it are skipped: resume)")
    g = p.add_argument_group("batch")
    g.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help="input lines read, sorted by prompt length and queued at a time "
                        f"(default {DEFAULT_WINDOW})")
    g.add_argument("--retry-errors", action="store_true",
                   help="on resume, remove OUT's error lines and run those lines again")
    g.add_argument("--fsync-interval", type=float, default=5.0,
                   help="seconds between fsyncs of OUT (default 5; always at the end)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    # --seed is the engine's (EngineConfig.seed); a line sets its own "seed".
    flags.add_sampling_flags(p, exclude=("seed",), for_lines=True)
    flags.add_engine_flags(p)
    flags.add_distributed_flags(p)


def add_batch_parser(sub: Any) -> None:
    b = sub.add_parser(
        "batch", help="run every request of a JSONL file; results as JSONL in input order",
        description=__doc__.split("\n\n", 1)[1].split("\nData flow:")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_batch_arguments(b)


def cmd_batch(args: argparse.Namespace) -> int:
    config = flags.engine_config_from_args(args)
    if args.process_id > 0:
        # Another host of a several-host job: it only runs process 0's steps; IN and OUT are
        # process 0's business (its host's files).
        return flags.join_or_follow(args, config) or 0  # ValueError if misconfigured
    in_path = pathlib.Path(args.input)
    out_path = pathlib.Path(args.output)
    if not in_path.is_file():
        raise FileNotFoundError(f"IN={args.input!r}: no such file")
    if out_path.is_dir():
        raise ValueError(f"OUT={args.output!r} is a directory")
    if not out_path.parent.is_dir():
        raise FileNotFoundError(f"OUT={args.output!r}: directory {str(out_path.parent)!r} "
                                "does not exist")
    if out_path.exists() and out_path.samefile(in_path):
        raise ValueError("IN and OUT must be different files")
    defaults = flags.sampling_kwargs_from_args(args)
    options = BatchOptions(window=args.window, defaults=defaults, retry_errors=args.retry_errors,
                           fsync_interval=args.fsync_interval, progress=not args.no_progress)
    flags.join_or_follow(args, config)  # process 0 of several: join the job

    from jaxserve.serving.served import build_offline_engine, model_name

    options = dataclasses.replace(options, model_names=(model_name(config),))

    t0 = time.perf_counter()
    # The engine loads the model itself, straight onto its devices' shardings.
    # --data-parallel-size N: a ReplicaPool, which takes the same calls as one Engine.
    engine = build_offline_engine(config, None, warmup=True, progress=options.progress)
    log.info("loaded and compiled %s in %.1fs", config.model or "the bundled model",
             time.perf_counter() - t0)
    try:
        summary = run_batch(engine, in_path, out_path, options)
    finally:
        engine.close()  # several hosts: the other processes stop following
    print(summary.format(), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The batch command on its own (`main([IN, OUT, ...])`): the same flags as `jaxserve batch`."""
    from jaxserve.config import RuntimeConfig, apply_runtime

    p = argparse.ArgumentParser(prog="batch_generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    add_batch_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    apply_runtime(RuntimeConfig.from_env())
    try:
        return cmd_batch(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"batch_generate: error: {e}", file=sys.stderr)
        return 2


__all__ = ["BatchOptions", "BatchSummary", "run_batch", "add_batch_parser", "cmd_batch",
           "main", "admit_line", "line_lora", "result_record"]
