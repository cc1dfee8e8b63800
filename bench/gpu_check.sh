#!/usr/bin/env bash
# odma-hw's GPU checks in one prepared run on a machine with an NVIDIA GPU and no network
# (`make gpu-check`). Run from the project's root with .device/ holding whl/ (wheels the GPU
# image lacks: cffi, pycparser, setuptools, wheel, packaging, transformers) and traces/ (the
# request traces). Every step has its own limit under one deadline (BUDGET seconds); the log
# goes to $OUT/log.txt and every step's output to $OUT/r.tgz.
# Preparing .device/ on a machine with network (the GPU image has python 3.12, torch, triton,
# numba, numpy, pytest, pytest-benchmark, safetensors and psutil; not cffi):
#   echo /.device/ >> .git/info/exclude; mkdir -p .device && cp -r ../shared/traces .device/
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .device/whl cffi==2.1.1 pycparser==3.12 \
#     setuptools==84.2.1 wheel packaging transformers==5.24.0
# Dry run on a CPU: DEV=torch:cpu SMALL=1 OUT=/tmp/gout bash bench/gpu_check.sh
# STEPS="check_tiny_* speed32" runs only the steps whose names match one of those patterns.
set -u
: "${OUT:?set OUT to a results folder}" "${DEV:=torch:cuda:0}"
OUT=$(realpath -m "$OUT")    # the archive at the end is written from /tmp
: "${SMALL:=0}" "${BUDGET:=480}"
ROOT=$(pwd); R=/tmp/gpu-r; rm -rf "$R"; mkdir -p "$R" "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
deadline=$((SECONDS + BUDGET))
step() {  # step NAME SECONDS CMD... (stdout to $R/NAME.out); the command's status in $rc,
  # 125 where STEPS left it out
  local name=$1 t=$2 p; shift 2
  if [ -n "${STEPS:-}" ]; then   # STEPS="glob ...": only the steps named (a short rerun)
    rc=125; for p in $STEPS; do [[ $name == $p ]] && rc=0; done
    ((rc == 0)) || return
  fi
  local left=$((deadline - SECONDS - 20)); ((t > left)) && t=$left
  ((t < 5)) && { echo "=== $name SKIPPED (no time)"; rc=124; return; }
  echo "=== $name (limit ${t}s) $*"
  # SIGTERM at the limit: odma-hw prints what it finished (as on Ctrl-C); SIGKILL 15 s later
  local t0=$SECONDS; timeout -k 15 "$t" "$@" > "$R/$name.out"; rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"; tail -c 1800 "$R/$name.out"; echo
}
W=.device/whl
if [ -d $W ] && ! python3 -c "import cffi" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    $W/cffi-*.whl $W/pycparser-*.whl $W/transformers-*.whl
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-index --find-links "$ROOT/$W" --no-deps -e . 2>&1 | tail -5
fi
PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python
nvidia-smi -L 2>/dev/null
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'transformers', transformers.__version__)"
$PY -c "import triton; print('triton', triton.__version__)" || true
OH="$PY -m odma_hw"
AZ=.device/traces/azure_conv_2023.csv; [ -f $AZ ] || AZ=../shared/traces/azure_conv_2023.csv
# without .device/ (the device tool's carry: [".device"]) every step would fail at once
[ -f "$AZ" ] && $PY -c "import cffi, transformers" 2>/dev/null || {
  echo "=== no traces or no cffi/transformers here: carry .device/ (see the header); stopping"
  exit 2; }
cut() {  # cut DST N PROMPT_CAP OUTPUT_CAP: the first N Azure requests, capped
  $PY - "$AZ" "$1" "$2" "$3" "$4" <<'PY'
import sys
src, dst, n, pc, oc = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
lines = open(src).read().splitlines()
head = lines[0].split(","); ip, io = head.index("num_prefill_tokens"), head.index("num_decode_tokens")
with open(dst, "w") as f:
    f.write("num_prefill_tokens,num_decode_tokens\n")
    for l in lines[1:n + 1]:
        c = l.split(","); f.write(f"{max(1, min(int(c[ip]), pc))},{max(1, min(int(c[io]), oc))}\n")
PY
}
# lengths only (no arrival times: every request is there at the start, as a check needs)
cut "$R/check_tiny.csv" 16 400 200; cut "$R/check_model.csv" 16 256 48
if [ "$SMALL" = 1 ]; then
  MODEL=tiny-llama; DT=float32; cut "$R/t32.csv" 8 64 8; cut "$R/t256.csv" 8 64 8
  MB=8; POOL=4; BIGMB=8; BIGPOOL=8; BIGLEN=80; TINYN=6
else
  MODEL=qwen2.5-0.5b; DT=bfloat16; cut "$R/t32.csv" 32 1024 128
  cut "$R/t256.csv" 256 2048 256; MB=32; POOL=512; BIGMB=128; BIGPOOL=4000; BIGLEN=2304; TINYN=16
fi
ALL=odma,static,s3,oracle,paged,extent,elastic
FIVE=odma,static,paged,extent,elastic
gb() { awk "BEGIN { print $1 / 1000 }"; }   # MB -> GB
E="$OH engine --device $DEV"
# until calibrate has made this card's own, the engine's extents take their knee from the
# preset of the card at hand
CARD=h100-sxm; nvidia-smi -L 2>/dev/null | grep -q H200 && CARD=h200
# 1. correctness on the device, every policy, a pool small enough to force migrations, in
# float32 (the check's tight tolerance; the model's own check below is bfloat16); where it
# fails, again without the fused layers, without CUDA graphs, then with torch's attention, and
# the rest runs as the first that passed
# (a STEPS rerun that names no tiny check: the first flags, as a full run that passed)
ran=; passed=
for try in "auto auto auto" "auto auto off" "off auto off" "off torch off"; do
  set -- $try
  step check_tiny_$1_$2_$3 60 $E --cuda-graphs $1 --attention $2 --fused-layers $3 \
    --model tiny-qwen2 --dtype float32 --trace "$R/check_tiny.csv" --requests $TINYN \
    --kv-pool-gb 0.0005 --policy $ALL --check --json
  ((rc == 125)) && continue
  ran=$try
  ((rc == 0)) && { passed=$try; break; }
done
set -- ${passed:-${ran:-auto auto auto}}; G=$1; ATT=$2; FUSED=$3
echo "=== the engine runs below: --cuda-graphs $G --attention $ATT --fused-layers $FUSED"
EM="$E --cuda-graphs $G --attention $ATT --model $MODEL --dtype $DT"   # each run names its card
E="$EM --fused-layers $FUSED --card $CARD"
# 2. speed: the first GPU run's 32 requests (max batch 32, 512 MB), every policy and
# transformers' continuous batching
step speed32 150 $E --trace "$R/t32.csv" --max-batch $MB --kv-pool-gb $(gb $POOL) \
  --policy $FIVE,hf --json
# 3. the full run: 256 requests, prompts <= 2048, outputs <= 256, max batch 128, a 4 GB pool
# (odma first, as on the runs where it trailed static; each row counts the kernels compiled
# inside its timed run)
step full256 130 $E --trace "$R/t256.csv" --max-batch $BIGMB --kv-pool-gb $(gb $BIGPOOL) \
  --max-model-len $BIGLEN --policy $FIVE --json
# the 32-request run with chunked prefill, 2,048 tokens a step (simulate predicts it too)
step speed32_chunked 60 $E --trace "$R/t32.csv" --max-batch $MB --kv-pool-gb $(gb $POOL) \
  --max-num-batched-tokens 2048 --policy odma,paged --json
# 4. a card of this device: the native probe of its memory, matmul throughput, the engine's own
# KV reads and steps (calibrate)
QUICK=; [ "$SMALL" = 1 ] && QUICK=--quick
PRESET=$CARD
step calibrate 240 $OH calibrate --device $DEV --model $MODEL $QUICK --out "$R/card.toml" --json
[ $rc = 0 ] && CARD="$R/card.toml"
# 5. simulate's predictions of those runs (the card calibrated here, and the preset)
S="$OH simulate --model $MODEL --dtype ${DT/bfloat16/bf16}"
S="${S/float32/fp32}"
for C in $(printf '%s\n' "$CARD" "$PRESET" | sort -u); do
  n=$(basename "$C" .toml)
  step sim32_$n 30 $S --card $C --trace "$R/t32.csv" --max-batch $MB --kv-pool-gb $(gb $POOL) \
    --policy $FIVE --json
  step sim32c_$n 30 $S --card $C --trace "$R/t32.csv" --max-batch $MB \
    --kv-pool-gb $(gb $POOL) --max-num-batched-tokens 2048 --policy odma,paged --json
  step sim256_$n 30 $S --card $C --trace "$R/t256.csv" --max-batch $BIGMB \
    --kv-pool-gb $(gb $BIGPOOL) --max-model-len $BIGLEN --policy $FIVE --json
done
E="$EM --fused-layers $FUSED --card $CARD"   # the runs below with the card calibrated here
# 6. the model's own check (bf16), every policy
step check_model 100 $E --trace "$R/check_model.csv" --kv-pool-gb 0.064 --policy $ALL --check \
  --json
# the CUDA tests: the native probe's, the torch device's, and a step on the kernels' path
# reading back only its tokens (a read there would stall the device and break its graph)
READS=tests/test_runner.py::test_a_step_on_the_kernels_path_reads_back_only_its_tokens
step pytest_gpu 60 $PY -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py \
  tests/test_torch_device.py $READS
# 7. as time allows: the 32-request run's odma and paged with transformers' modules in place
# of the fused layers: the launches a layer costs, side by side on the card
step speed32_modules 50 $EM --card $CARD --fused-layers off --trace "$R/t32.csv" \
  --max-batch $MB --kv-pool-gb $(gb $POOL) --policy odma,paged --json
# and with whole prompts over the run tables (one launch a layer) in place of flash attention
# per prompt: which the prefill steps should use
step speed32_prompt_runs 50 $E --prompt-attention runs --trace "$R/t32.csv" --max-batch $MB \
  --kv-pool-gb $(gb $POOL) --policy odma,paged --json
# then as time allows: transformers at its best (its own CUDA graphs asked for) on the
# 32-request run; the full run's first two policies the other way round (whatever the first
# policy measured pays that the warm-up did not: it trailed static by 1.5-1.9x on the first H100
# runs); the decode kernel's KV read rate by layout (beside the probe's sequential read in
# calibrate's card) and a decode step from its graph, fused and not; transformers on the full run
# (its own flags: the fallback's torch attention above would refuse --cuda-graphs on)
HFG="$OH engine --device $DEV --cuda-graphs on --model $MODEL --dtype $DT --card $CARD"
if [ "${HF_GRAPHS:-1}" = 1 ]; then
  step speed32_hf_graphs 40 $HFG --trace "$R/t32.csv" --max-batch $MB --kv-pool-gb $(gb $POOL) \
    --policy hf --json
fi
step full256_rev 90 $E --trace "$R/t256.csv" --max-batch $BIGMB --kv-pool-gb $(gb $BIGPOOL) \
  --max-model-len $BIGLEN --policy static,odma --json
step kernel_bench 100 $PY -m pytest bench/bench_run_attention.py \
  bench/bench_engine.py::test_cuda_graph_decode_step --benchmark-only -q \
  -p no:cacheprovider --benchmark-json "$R/kernel_bench.json"
if [ "${HF_GRAPHS:-1}" = 1 ]; then
  step full256_hf 70 $HFG --trace "$R/t256.csv" --max-batch $BIGMB --kv-pool-gb $(gb $BIGPOOL) \
    --max-model-len $BIGLEN --policy hf --json
fi
cp "$R"/card.* "$OUT"/ 2>/dev/null
$PY bench/gpu_summary.py "$R" | tee "$OUT/summary.txt"
(cd /tmp && tar czf "$OUT/r.tgz" gpu-r)
echo "=== done $SECONDS s"
