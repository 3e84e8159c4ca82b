"""One process of a two-process offline job (tests/test_multihost.py): the README's Python
recipe. Process 0 generates with `LLM` and prints the tokens as JSON; process 1 follows.

usage: multihost_llm_worker.py RANK COORDINATOR MODEL_DIR   (2 virtual CPU devices each)
"""

from __future__ import annotations

import json
import sys

from jaxserve import LLM, EngineConfig, SamplingParams, multihost
from jaxserve.config import DistributedConfig
from jaxserve.llm import build_follower

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 70))]
ENGINE = dict(tensor_parallel_size=4, attention_impl="reference", max_num_seqs=8,
              max_num_batched_tokens=64, page_size=8, max_model_len=256,
              kv_cache_memory=1 << 20)

if __name__ == "__main__":
    rank, coordinator, model = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    multihost.initialize(DistributedConfig(coordinator, num_processes=2, process_id=rank))
    if rank == 0:
        with LLM(model=model, **ENGINE) as llm:
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8,
                                                        ignore_eos=True), use_tqdm=False)
        print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
    else:
        steps = multihost.follow(build_follower(EngineConfig(model=model, **ENGINE)))
        print(json.dumps({"steps": steps}))
