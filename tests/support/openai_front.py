"""What the OpenAI front tests (tests/server/test_openai_*.py, the README's and the gRPC
prompt-logprobs test) share: the config of the served tiny engine and of its offline oracle
(tests/server/conftest.py's `llm`), request constants, and the offline API's loop."""

from __future__ import annotations

from support.engine_fixtures import FEW_TOKEN_BUCKETS

from jaxserve import SamplingParams

# The engine config of every OpenAI front test module (chat, echo, sdk, serving, README too)
# and of test_server's gRPC one: two token buckets, 7 warmup compiles per engine instead of
# 26, and one process compiles them once for all of these.
CONFIG = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_model_len=512,
              token_buckets=FEW_TOKEN_BUCKETS)
DEADLINE_S = 30.0
GREEDY = dict(temperature=0, ignore_eos=True)
CHAT = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w5 w9 w33"},
        {"role": "assistant", "content": "w7 w8"}, {"role": "user", "content": "w10"}]
NO_EOS = {"ignore_eos": True}  # vLLM's extra, through the SDK's extra_body
SDK_KEY = "sdk-key"  # the API key of conftest's `sdk_server`


def offline(engine, prompt, params: SamplingParams):  # noqa: ANN001, ANN201
    """The offline API's loop: add, step to completion, the final RequestOutput."""
    engine.add_request("o", prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
    return final
