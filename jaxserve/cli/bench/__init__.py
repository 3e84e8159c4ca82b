"""Serving benchmarks: load generator (`jaxserve bench`), chunked-prefill scenario, SLO tuner
(`jaxserve tune`). Modules: workload (what to send), targets (where: gRPC / OpenAI HTTP), load
(how: closed / open loop), report (figures), sweep (runs + result documents), plots, launch
(in-process server), scenario, tune, cli. Also the library of two scripts: soak + soak_kinds
(`scripts/soak/soak.py`: mixed requests against a `jaxserve serve`, then leak checks) and
perf_model (`scripts/bench/perf_model.py`: the roofline model of a step)."""
