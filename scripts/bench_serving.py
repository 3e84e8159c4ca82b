#!/usr/bin/env python
"""Serving load generator: the same command as `jaxserve bench` (see --help).

    python scripts/bench_serving.py --concurrency 1,4,16 --num-requests 32   # in-process
    python scripts/bench_serving.py --target grpc://127.0.0.1:50051 --request-rate 1,2,4
    python scripts/bench_serving.py --target http://127.0.0.1:8000 --concurrency 8,32
"""

import sys

from jaxserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
