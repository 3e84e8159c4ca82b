"""Serving benchmarks: load generator (`jaxserve bench`), chunked-prefill scenario, SLO tuner
(`jaxserve tune`). Modules: workload (what to send), targets (where: gRPC / OpenAI HTTP), load
(how: closed / open loop), report (figures), sweep (runs + result documents), plots, launch
(in-process server), scenario, tune, cli."""
