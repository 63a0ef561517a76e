"""``ragspec doctor``: which of ragspec's speed-ups run on this machine, and why not.

It says whether the compiled CPU kernels load (and why not: switched off, a CPU or
platform they do not run on, sources missing from the installation, no C++ compiler or
ninja, a failed build), the instruction set they use, whether the fused native decoder step
runs (``--model``: for that model, which is then loaded; otherwise only whether the library
holds it), the numerics and drafting a command would use, whether ragspec's CUDA backend is
available, the library versions and the kernel cache folder. The same facts are the
``"kernels"`` key of ``ragspec model info --json`` (:func:`kernel_report`).

Without ``--model`` nothing but the kernels is loaded: they are built first when they are not
in the cache (minutes on a small CPU; ``--no-build`` only looks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..backend.base import Capability
from ..config import AUTO_DRAFTING, DRAFTING_MODES, NUMERICS

if TYPE_CHECKING:
    from ..backend.base import Target

__all__ = ["kernel_report", "add_doctor_command", "cmd_doctor"]

# the CPU flags the kernels' paths depend on (/proc/cpuinfo names)
_CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_flags() -> Optional[list[str]]:
    """The kernel-relevant flags of this CPU (Linux: /proc/cpuinfo), or None elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return [flag for flag in _CPU_FLAGS if flag in have]
    return None


def _cuda_facts(model: Optional[torch.nn.Module], target: Optional["Target"] = None) -> dict[str, Any]:
    """Whether ragspec's CUDA backend would serve (``model`` on CUDA when given) and, for a
    loaded ``target`` that replays its step from CUDA graphs, its graphs and step counts."""
    from ..backend.cuda import kernels as cuda_kernels
    from ..backend.cuda import unsupported_reason

    device = torch.cuda.is_available()
    reason: Optional[str] = None
    # the first thing to fix first: the device and torch's build before triton and the model
    if os.environ.get("RAGSPEC_CUDA_BACKEND", "1") == "0":
        reason = "switched off: RAGSPEC_CUDA_BACKEND=0"
    elif torch.version.cuda is None:
        reason = f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch (see docs/gpu.md)"
    elif not device:
        reason = (
            f"no CUDA device visible (torch.cuda.is_available() is False; torch built for CUDA {torch.version.cuda})"
        )
    elif not cuda_kernels.triton_available():
        reason = "triton is not installed (pip install triton)"
    elif model is not None:
        reason = unsupported_reason(model)
    counts = target.capability(Capability.STEP_COUNTS) if target is not None else None
    return {
        "device_present": device,
        "device_name": torch.cuda.get_device_name(0) if device else None,
        "torch_cuda": torch.version.cuda,
        "triton": cuda_kernels.triton_available(),
        "backend_available": reason is None,
        "reason": reason,
        "graphs": None
        if counts is None
        else {
            "captured": list(counts.captured),
            "failed": list(counts.failed),
            "graph_steps": counts.graph_steps,
            "eager_steps": counts.eager_steps,
        },
    }


def kernel_report(
    *,
    model: Optional[str] = None,
    device: Optional[str] = None,
    dtype: Optional[str] = None,
    numerics: Optional[str] = None,
    drafting: Optional[str] = None,
    build: bool = True,
    target: Optional["Target"] = None,
    gguf: Optional[Path] = None,
) -> dict[str, Any]:
    """What ragspec would run here, as JSON-able data.

    Args:
        model: a model (registry name, GGUF file or HF folder) to load into its backend to
            check its native step (None: the model is not loaded, only the kernels).
        device, dtype: as ``--device`` / ``--dtype`` (None: CUDA when present, else CPU).
        numerics, drafting: as ``--numerics`` / ``--drafting`` (None: ``RAGSPEC_NUMERICS``
            / ``RAGSPEC_DRAFTING``, else ``"exact"`` / ``"auto"``).
        build: compile the CPU kernels when they are not in the cache.
        target: a model already loaded into its backend (``ragspec model info``, through
            :func:`ragspec.loading.select_target`) instead of ``model``.
        gguf: the GGUF file ``target``'s model came from, if any.

    Returns:
        ``{"versions", "cpu": {"flags", "torch_capability", "isa_override"}, "cpu_kernels":
        {"active", "state", "reason", "isa", "fast_numerics", "decoder_step",
        "missing_sources"}, "native_step": {"runs", "reason"}, "numerics", "drafting",
        "cuda", "cache"}``; ``native_step.runs`` is None when no model was checked.

    Raises:
        RagspecError: ``model`` cannot be loaded, or a bad device / numerics / drafting.
    """
    from ..backend.cpu import kernels
    from ..errors import ConfigError
    from ..loading import load_target, resolve_drafting
    from ..models import cache_dir
    from ..models.load import resolve_device

    numerics = numerics or os.environ.get("RAGSPEC_NUMERICS") or "exact"
    if numerics not in NUMERICS:
        raise ConfigError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    drafting = drafting or os.environ.get("RAGSPEC_DRAFTING") or AUTO_DRAFTING
    status = kernels.kernel_status(build=build)
    asked = _asked_device(device) if target is None else None
    if asked is not None and model is not None:
        # a model cannot be loaded onto a CUDA device that is not here: say why it is not
        raise ConfigError(f"device {device!r} asked for but CUDA is not available: {_cuda_facts(None)['reason']}")
    if target is None and model is not None:
        target, _, spec = load_target(model, device, dtype, numerics=numerics)
        gguf = spec.gguf_file
    run_device = target.device if target is not None else asked or resolve_device(device)
    resolved_drafting = resolve_drafting(drafting, run_device)
    hf_model = target.model if target is not None else None

    native = _native_step_facts(target, run_device, status)
    fast_off = _fast_numerics_off(target, run_device, status, gguf)
    return {
        "ragspec": _version("ragspec"),
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "versions": {name: _version(name) for name in ("torch", "transformers", "triton")},
        "cpu": {
            "flags": _cpu_flags(),
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_override": os.environ.get("RAGSPEC_CPU_ISA") or None,
        },
        "cpu_kernels": {
            "active": status.active,
            "state": status.state,
            "reason": status.reason,
            "isa": status.isa,
            "fast_numerics": status.fast_numerics,
            "decoder_step": status.decoder_step,
            "missing_sources": list(status.missing_sources),
        },
        "native_step": native,
        "model": None
        if hf_model is None
        else {
            "backend": type(target).__name__,
            "device": str(run_device),
            "dtype": str(next(hf_model.parameters()).dtype).removeprefix("torch."),
            "gguf": str(gguf) if gguf else None,
        },
        "numerics": {"requested": numerics, "fast_available": fast_off is None, "fast_reason": fast_off},
        "drafting": {"requested": drafting, "resolved": resolved_drafting, "device": str(run_device)},
        "cuda": _cuda_facts(hf_model if hf_model is not None and run_device.type == "cuda" else None, target),
        "cache": {
            "cache_dir": str(cache_dir()),
            "kernel_dir": str(status.kernel_dir) if status.kernel_dir else None,
        },
    }


def _asked_device(device: Optional[str]) -> Optional[torch.device]:
    """The CUDA device ``device`` names on a machine where CUDA is not available (the report
    is then about it, its ``cuda.reason`` saying why it is not there); None otherwise."""
    if device is None or torch.cuda.is_available():
        return None
    try:
        asked = torch.device(device)
    except (RuntimeError, TypeError):
        return None  # unparsable: resolve_device says so
    return asked if asked.type == "cuda" else None


def _native_step_facts(target: Optional["Target"], run_device: torch.device, status: Any) -> dict[str, Any]:
    """``kernel_report``'s ``"native_step"``: whether it is switched on and compiled, and
    whether ``target`` runs it (None without a target), and why not."""
    from ..backend.cpu.native import native_step_enabled

    native: dict[str, Any] = {"enabled": native_step_enabled(), "in_library": status.decoder_step}
    if target is None:
        native.update(runs=None, reason="give --model to load a model and check its native step")
        return native
    # only the CPU backend has a native step (its speed-ups say why not)
    speed_ups = target.capability(Capability.SPEED_UPS)
    off = (
        speed_ups.native_step_off
        if speed_ups is not None
        else f"the native step is the CPU backend's; the model is on {run_device}"
    )
    native.update(runs=off is None, reason=off)
    return native


def _fast_numerics_off(
    target: Optional["Target"], run_device: torch.device, status: Any, gguf: Optional[Path]
) -> Optional[str]:
    """Why ``--numerics fast`` cannot be served here (for ``target`` when given), or None."""
    if run_device.type == "cuda":
        return None  # the CUDA backend's "fast" is cuBLAS linears
    if not status.active:
        return "needs the compiled CPU kernels"
    if not status.fast_numerics:
        return "needs a CPU with AVX-512 VNNI (and RAGSPEC_CPU_ISA not avx2)"
    if target is not None and gguf is None:
        return "needs a GGUF model"
    return None


def _print_text(report: dict[str, Any]) -> None:
    k = report["cpu_kernels"]
    if k["active"]:
        print(f"CPU kernels:  active, {k['isa']} path" + (", fast numerics (VNNI)" if k["fast_numerics"] else ""))
    else:
        print(f"CPU kernels:  NOT active ({k['state']}): {k['reason']}")
    n = report["native_step"]
    runs = {True: "runs", False: "off", None: "not checked"}[n["runs"]]
    print(f"native step:  {runs}" + (f" ({n['reason']})" if n["reason"] else ""))
    num = report["numerics"]
    print(
        f"numerics:     {num['requested']}"
        + ("" if num["fast_available"] else f" (fast unavailable: {num['fast_reason']})")
    )
    d = report["drafting"]
    print(f"drafting:     {d['requested']} -> {d['resolved']} on {d['device']}")
    c = report["cuda"]
    print("CUDA backend: " + ("available" if c["backend_available"] else f"not available ({c['reason']})"))
    g = c.get("graphs")
    if g is not None:
        rows = f" ({g['captured'][0]}-{g['captured'][-1]} rows)" if g["captured"] else ""
        failed = f", capture FAILED for {g['failed']} rows (eager)" if g["failed"] else ""
        print(f"CUDA graphs:  {len(g['captured'])} captured{rows}{failed}; steps so far "
              f"{g['graph_steps']} graphed, {g['eager_steps']} eager")  # fmt: skip
    print("versions:     " + ", ".join(f"{name} {v or '-'}" for name, v in report["versions"].items()))
    print(f"kernel cache: {report['cache']['kernel_dir'] or '-'}")


def cmd_doctor(args: argparse.Namespace) -> int:
    """``ragspec doctor``: print the report; exit 1 with ``--require-kernels`` when the
    compiled CPU kernels are not active."""
    report = kernel_report(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        numerics=args.numerics,
        drafting=args.drafting,
        build=not args.no_build,
    )
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_text(report)
    if args.require_kernels and not report["cpu_kernels"]["active"]:
        print(
            f"ragspec: error: the compiled CPU kernels are not active: {report['cpu_kernels']['reason']}",
            file=sys.stderr,
        )
        return 1
    return 0


def add_doctor_command(sub: Any) -> None:
    """Add ``ragspec doctor`` to the CLI's subcommands."""
    d = sub.add_parser(
        "doctor",
        help="which speed-ups run here (compiled CPU kernels, ISA, native step, CUDA backend) and why not",
    )
    d.add_argument(
        "--model",
        default=None,
        help="also load this model (registry name, GGUF file or HF folder) and check its native decoder step",
    )
    d.add_argument("--device", default=os.environ.get("RAGSPEC_DEVICE"), help="cpu, cuda ... (default: as generate)")
    d.add_argument("--dtype", default=os.environ.get("RAGSPEC_DTYPE"), help="fp32, bf16, fp16 (with --model)")
    d.add_argument("--numerics", choices=NUMERICS, default=None, help="the numerics to check (default: exact)")
    d.add_argument(
        "--drafting",
        choices=(AUTO_DRAFTING, *DRAFTING_MODES),
        default=None,
        help="the drafting to check (default: auto)",
    )
    d.add_argument(
        "--no-build", action="store_true", help="do not compile the CPU kernels when they are not in the cache yet"
    )
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.add_argument(
        "--require-kernels", action="store_true", help="exit with status 1 when the compiled CPU kernels are not active"
    )
    d.set_defaults(func=cmd_doctor)
