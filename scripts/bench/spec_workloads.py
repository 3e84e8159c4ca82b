#!/usr/bin/env python
"""The two request sets of the speculative decoding benchmark, as JSONL for `vllm bench serve
--dataset-name custom` (one {"prompt": ...} per line; the client applies the chat template).

  copy   "repeat / summarise this passage" over prose passages taken from the docstrings of
         Python's standard library (present on every machine, the same text for a given
         Python version): the output copies spans of the prompt, where n-gram lookup pays.
  open   open-ended requests (stories, explanations) whose output copies nothing given.

    python scripts/bench/spec_workloads.py --out spec_workloads   # copy.jsonl, open.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pathlib
import random

# Standard-library modules whose docstrings hold a few paragraphs of plain prose.
MODULES = ("heapq", "textwrap", "json", "bisect", "difflib", "fractions", "decimal",
           "functools", "itertools", "logging", "pickle", "queue", "random", "shutil",
           "string", "tempfile", "threading", "zipfile", "sched", "abc", "contextlib",
           "dataclasses", "enum", "graphlib", "hmac", "ipaddress", "locale", "mimetypes")
COPY_TASKS = ("Repeat the following passage word for word:\n\n{p}",
              "Summarise the following passage, quoting its key sentences exactly:\n\n{p}",
              "Rewrite the following passage as a bulleted list, keeping its wording:\n\n{p}")
TOPICS = ("a lighthouse keeper", "a lost umbrella", "the first day at a new school",
          "a robot learning to paint", "a storm at sea", "an old library", "a desert journey",
          "a talking cat", "a mountain village", "a winter market", "a broken clock",
          "a city garden", "a train that never stops", "a letter from the future")
CONCEPTS = ("photosynthesis", "compound interest", "how vaccines work", "plate tectonics",
            "the water cycle", "how a compiler works", "supply and demand", "black holes",
            "how bridges carry weight", "the immune system", "recursion", "inflation")
OPEN_TASKS = ("Write a short story about {t}.", "Explain {c} to a beginner.",
              "Write a poem about {t}.", "What are the main ideas behind {c}?")


def passages(min_chars: int = 400, max_chars: int = 1200) -> list[str]:
    """Prose paragraphs (no code, no tables) of the docstrings of MODULES and their public
    classes and functions, joined into passages of min_chars to max_chars."""
    paras = []
    for name in MODULES:
        mod = importlib.import_module(name)
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for obj in objs:
            if obj is not mod and getattr(obj, "__module__", None) != name:
                continue  # re-exported from elsewhere: seen there, or not prose of ours
            doc = inspect.getdoc(obj) or ""
            for p in doc.split("\n\n"):
                if any(s in p for s in (">>>", "::", "|", "    ")):
                    continue
                p = " ".join(p.split())
                if len(p) > 80 and p not in paras:
                    paras.append(p)
    out, text = [], ""
    for p in paras:
        if text and len(text) + len(p) > max_chars:
            if len(text) >= min_chars:
                out.append(text)
            text = ""
        text = f"{text} {p}".strip()[:max_chars]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="spec_workloads")
    ap.add_argument("--num", type=int, default=96, help="requests in each set")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    ps = passages()
    copy = [rng.choice(COPY_TASKS).format(p=rng.choice(ps)) for _ in range(args.num)]
    open_ = [rng.choice(OPEN_TASKS).format(t=rng.choice(TOPICS), c=rng.choice(CONCEPTS))
             for _ in range(args.num)]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, prompts in (("copy", copy), ("open", open_)):
        with open(out / f"{name}.jsonl", "w") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": p}) + "\n")
        print(f"{out / name}.jsonl: {len(prompts)} prompts")
    print(f"{len(ps)} passages")


if __name__ == "__main__":
    main()
