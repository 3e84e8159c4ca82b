"""`jaxserve tune --apply grpc://HOST:PORT`: push the tuner's best setting to a live server.

Data flow: the tune document (just measured, or `--from-json`) -> its `best` row (None: no
setting met the targets -> nothing is sent, exit 1 with the reason) -> {max_num_batched_tokens,
max_num_seqs, decode_token_budget: None (the tuner measures every step at the one budget)}
-> `Client.update_scheduler` (gRPC Admin.UpdateSchedulerConfig, with `--api-key`) -> the
settings the server now runs with, printed; a refusal (a value past what that server
compiled, no key, admin off) -> exit 1 with the server's message. The server checks
everything (`engine/live_settings.py`); requests it is running keep running.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

SCHEME = "grpc://"


def server_address(text: str) -> str:
    """`grpc://HOST:PORT` -> HOST:PORT (checked when the flags are read, before a tune)."""
    if not text.startswith(SCHEME) or not text[len(SCHEME):]:
        raise argparse.ArgumentTypeError(f"{text!r} must be {SCHEME}HOST:PORT")
    return text[len(SCHEME):]


def add_apply_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--apply", default=None, metavar="grpc://HOST:PORT", type=server_address,
                   help="after tuning, set the best max_num_batched_tokens / max_num_seqs on "
                        "this running server (its admin endpoint: give --api-key, or run it "
                        "with --enable-admin); exit 1 when no setting met the targets or the "
                        "server refused")
    p.add_argument("--api-key", default=None, help="API key of the --apply server")


def best_changes(doc: dict) -> dict[str, Any] | None:
    """The scheduler changes of the document's best setting (None: there is none)."""
    best = doc.get("best")
    if best is None:
        return None
    return {"max_num_batched_tokens": best["max_num_batched_tokens"],
            "max_num_seqs": best["max_num_seqs"], "decode_token_budget": None}


def apply_best(doc: dict, target: str, api_key: str | None) -> int:
    """Push `doc`'s best setting to the server at `target` (HOST:PORT); the exit status (0:
    the server runs it)."""
    import grpc

    from jaxserve.server.client import Client

    changes = best_changes(doc)
    if changes is None:
        print(f"--apply: nothing sent to {target}: no setting met the targets", file=sys.stderr)
        return 1
    with Client(target, api_key=api_key, timeout=30.0) as client:
        try:
            now = client.update_scheduler(**changes)
        except grpc.RpcError as e:
            print(f"--apply: {target} refused the setting: {e.code().name}: {e.details()}",
                  file=sys.stderr)
            return 1
    print(f"applied to {target}; it now runs: " +
          " ".join(f"{k}={'none' if v is None else v}" for k, v in now.items()))
    return 0
