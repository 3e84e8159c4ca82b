"""`jaxserve tune --apply grpc://HOST:PORT` against a running in-process server (fake-runner
engine behind an API key): a saved tune's best setting (`--from-json`: the same code path as
after a sweep) is pushed through the Admin service and printed as the server now runs it;
no feasible setting, a setting past the server's compiled bounds, or no key: exit 1, the
server's settings untouched."""

from __future__ import annotations

import json

import pytest
from support.fake_engines import fake_engine

from jaxserve.cli.main import main
from jaxserve.server.background import BackgroundServer
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel

KEY = "tune-key"


def _summary(tok_s: float, ttft_ms: float) -> dict:
    return {"completed": 8, "failed": 0, "incomplete": 0, "output_throughput": tok_s,
            "ttft_ms": {"p99": ttft_ms}, "itl_ms": {"p99": 20.0}}


def _doc(rows: list[tuple[int, int, float, float]]) -> dict:
    return {"name": "tune", "model": "fake", "workload": "w", "load": "c4", "elapsed_s": 1.0,
            "slo": {"ttft_p99_s": 1, "itl_p99_s": 1}, "best": None,
            "rows": [{"max_num_batched_tokens": t, "max_num_seqs": s, "meets_slo": False,
                      "status": "ok", "summary": _summary(v, ttft)} for t, s, v, ttft in rows]}


@pytest.fixture(scope="module")
def server():  # noqa: ANN201
    srv = BackgroundServer(ServerConfig(port=0, http_port=None, api_keys=(KEY,)),
                           lambda: ServedModel(fake_engine(), "fake")).start()
    yield srv
    srv.stop()


def _tune(tmp_path, server, rows, *extra: str) -> int:  # noqa: ANN001
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(_doc(rows)))
    return main(["tune", "--ttft-p99", "1", "--itl-p99", "1", "--from-json", str(path),
                 "--apply", f"grpc://{server.target}", *extra])


def _live(server) -> dict:  # noqa: ANN001
    return server.server.engine.engine.scheduler_settings()


def test_apply_pushes_the_best_setting(tmp_path, server, capsys) -> None:  # noqa: ANN001
    # (64, 4) is faster but misses TTFT; (16, 2) meets it but is slower than (32, 4).
    rows = [(16, 2, 50.0, 300.0), (32, 4, 100.0, 400.0), (64, 4, 150.0, 5000.0)]
    assert _live(server)["max_num_batched_tokens"] == 64
    assert _tune(tmp_path, server, rows, "--api-key", KEY) == 0
    live = _live(server)
    assert (live["max_num_batched_tokens"], live["max_num_seqs"],
            live["decode_token_budget"]) == (32, 4, None)
    out = capsys.readouterr().out
    assert "it now runs: max_num_seqs=4 max_num_batched_tokens=32 decode_token_budget=none" \
        in out


@pytest.mark.parametrize("rows,key,message", [
    ([(32, 4, 100.0, 5000.0)], KEY, "nothing sent to 127.0.0.1:"),  # nothing feasible
    ([(128, 4, 100.0, 10.0)], KEY, "refused the setting: INVALID_ARGUMENT: "
                                   "max_num_batched_tokens=128 is past what start-up compiled: at most 64"),
    ([(16, 2, 100.0, 10.0)], None, "refused the setting: UNAUTHENTICATED"),
])
def test_apply_refused_changes_nothing(tmp_path, server, capsys, rows, key, message
                                       ) -> None:  # noqa: ANN001
    before = _live(server)
    assert _tune(tmp_path, server, rows, *(("--api-key", key) if key else ())) == 1
    assert message in capsys.readouterr().err
    assert _live(server) == before


def test_apply_needs_a_grpc_url(tmp_path, server) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--ttft-p99", "1", "--itl-p99", "1", "--from-json", "x.json",
              "--apply", server.target])  # no grpc://
    assert exit_.value.code == 2
