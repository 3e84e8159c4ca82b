"""jaxserve.cli: the `jaxserve` command (generate, convert, serve, client, batch, bench, tune).

`main` parses argv and dispatches; `flags` holds the flags every subcommand shares (generated
from the config dataclasses); `serve`, `batch_job` and `bench` are the subcommands' modules.
"""

from jaxserve.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
