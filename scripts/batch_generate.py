"""Batch inference over a JSONL file: the same command as `jaxserve batch IN OUT ...`.

    python scripts/batch_generate.py prompts.jsonl results.jsonl --model DIR --max-tokens 64

See `jaxserve/cli/batch_job.py` (or `--help`) for the line formats, resume and crash safety.
"""

from __future__ import annotations

import sys

from jaxserve.cli.batch_job import main

if __name__ == "__main__":
    sys.exit(main())
