"""One process of a two-process offline job (tests/device/test_multihost.py): the Python
recipe of docs/scaling.md. Process 0 generates with `LLM`, idles long enough to announce a few keepalives,
generates again and prints the tokens as JSON; process 1 follows and prints what it ran.

usage: multihost_llm_worker.py RANK COORDINATOR MODEL_DIR   (2 virtual CPU devices each)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from support.engine_fixtures import FEW_TOKEN_BUCKETS  # tests/ is on the path

from jaxserve import LLM, EngineConfig, SamplingParams
from jaxserve.config import DistributedConfig
from jaxserve.device import multihost
from jaxserve.serving.build import build_follower

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 70))]
ENGINE = dict(tensor_parallel_size=4, attention_impl="reference", max_num_seqs=8,
              max_num_batched_tokens=64, page_size=8, max_model_len=256,
              kv_cache_memory=1 << 20, multihost_keepalive_s=0.2,
              token_buckets=FEW_TOKEN_BUCKETS)

if __name__ == "__main__":
    rank, coordinator, model = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    multihost.initialize(DistributedConfig(coordinator, num_processes=2, process_id=rank))
    if rank == 0:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        with LLM(model=model, **ENGINE) as llm:
            first = llm.generate(PROMPTS[:1], params, use_tqdm=False)
            # Idle until process 0 has announced itself a few times, then generate again.
            deadline = time.monotonic() + 60
            while llm.engine.runner.keepalives < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            # The last prompt with a logit bias: the followers get it in the step broadcast.
            # And prompt logprobs: their arrays travel in a third broadcast.
            biased = dataclasses.replace(params, logit_bias={123: 100.0}, prompt_logprobs=2)
            outs = first + llm.generate(PROMPTS[1:], [params, biased], use_tqdm=False)
        keepalives = llm.engine.runner.keepalives  # after close: no keepalive can follow
        print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                          "prompt_logprobs": [{str(k): v for k, v in e.items()}
                                              for e in outs[-1].prompt_logprobs[1:]],
                          "keepalives": keepalives}))
    else:
        stats = multihost.follow(build_follower(EngineConfig(model=model, **ENGINE)))
        print(json.dumps(dataclasses.asdict(stats)))
