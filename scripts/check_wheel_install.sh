#!/usr/bin/env bash
# The clean-install check: what a new user gets from `pip install` of a wheel.
#
#   scripts/check_wheel_install.sh            (CI: .ci/run calls it right after `make test`)
#
# 1. a clean copy of the checkout's tracked files (a file git does not track is not in it),
#    `pip wheel . --no-deps` from it;
# 2. a fresh venv: torch==2.13.0 (TORCH_SPEC; a CPU build from this machine's package index),
#    then the wheel (its dependencies from the same index; pip's cache is reused);
# 3. from a folder outside the checkout, with an EMPTY ragspec cache (RAGSPEC_CACHE=a new
#    temporary folder: the kernels are compiled from the installed package's sources, a few
#    minutes on 2 cores): `ragspec model fetch` (or RAGSPEC_CHECK_MODEL=a GGUF file already
#    fetched, to save the download), `ragspec generate ... --max-new-tokens 16` and
#    `ragspec doctor --json --model` (the same model).
# It fails unless generation succeeds, doctor says the compiled CPU kernels are active and the
# model's native decoder step runs, and no kernel warning (one that says torch's kernels are
# used instead) was printed. The compile notice of the first use ("compiling the CPU decoding
# kernel") is expected, not a warning of a fallback. KEEP_CHECK_DIR=1 keeps the temporary
# folder for a look afterwards.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ragspec-wheel-check.XXXXXX")"
cleanup() { if [ "${KEEP_CHECK_DIR:-0}" = 1 ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi; }
trap cleanup EXIT
say() { echo "check_wheel_install: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

# 1. the wheel, from a clean copy of the tracked files (the checkout keeps no build/ or egg-info)
mkdir -p "$WORK/src" "$WORK/dist" "$WORK/run"
if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -z | tar --null -T - -cf -) | tar -xf - -C "$WORK/src"
else
    cp -R "$ROOT/." "$WORK/src"
fi
say "building the wheel"
"$PYTHON" -m pip wheel -q "$WORK/src" --no-deps -w "$WORK/dist"
WHEEL="$(ls "$WORK"/dist/ragspec-*.whl)"

# 2. a fresh venv: torch first and pinned (an unpinned torch pulls CUDA), then the wheel
say "installing $TORCH_SPEC and $(basename "$WHEEL") into a fresh venv"
"$PYTHON" -m venv "$WORK/venv"
VBIN="$WORK/venv/bin"
"$VBIN/python" -m pip install -q "$TORCH_SPEC"
"$VBIN/python" -m pip install -q "$WHEEL"

# 3. outside the checkout, an empty cache: the kernels are built from the installed sources
cd "$WORK/run"
export RAGSPEC_CACHE="$WORK/cache"
unset RAGSPEC_CPU_KERNELS RAGSPEC_NATIVE_STEP RAGSPEC_CPU_ISA PYTHONPATH RAGSPEC_MODEL
if [ -n "${RAGSPEC_CHECK_MODEL:-}" ]; then
    MODEL="$RAGSPEC_CHECK_MODEL"
else
    say "fetching the default model into the empty cache"
    MODEL="$("$VBIN/ragspec" model fetch)"
fi
"$VBIN/python" -c "import ragspec, sys; sys.exit(0 if '$WORK/venv' in ragspec.__file__ else 'ragspec imported from ' + ragspec.__file__)"

say "generating (the first use compiles the kernels: minutes on a small CPU)"
"$VBIN/ragspec" generate --model "$MODEL" "What is speculative decoding?" --max-new-tokens 16 \
    >"$WORK/generate.out" 2>"$WORK/generate.err" || { cat "$WORK/generate.err" >&2; fail "ragspec generate"; }
cat "$WORK/generate.out"
"$VBIN/ragspec" doctor --json --model "$MODEL" >"$WORK/doctor.json" 2>"$WORK/doctor.err" \
    || { cat "$WORK/doctor.err" >&2; fail "ragspec doctor"; }

# a kernel warning: any warning that names a kernel, except the first use's compile notice
if grep -i "warning" "$WORK/generate.err" "$WORK/doctor.err" | grep -i "kernel" \
    | grep -v "compiling the CPU decoding kernel (first use only"; then
    fail "a kernel warning was printed (above)"
fi
"$VBIN/python" - "$WORK/doctor.json" <<'EOF' || fail "the fast path does not run (doctor's report above)"
import json, sys
report = json.load(open(sys.argv[1]))
shown = ("cpu_kernels", "native_step", "model", "cache", "versions")
print(json.dumps({key: report[key] for key in shown}, indent=1))
sys.exit(0 if report["cpu_kernels"]["active"] and report["native_step"]["runs"] else 1)
EOF
say "ok: the wheel installs, the kernels build and load from an empty cache, generation runs the fast path"
