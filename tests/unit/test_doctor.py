"""``ragspec doctor`` and ``model info --json``'s ``"kernels"``: which compiled CPU kernels are
active, and why not (issue 40: "nothing says which kernels are active").

The kernel loader is monkeypatched for each way it can refuse (switched off, sources missing,
no compiler, a failed build) and for a loaded library; the ``--model`` cases load a tiny
random Llama folder through the real kernels (skipped where they cannot be built)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from test_kernels import _BUILDABLE

from ragspec import cli
from ragspec.backend.cpu import kernels
from ragspec_testing import make_char_tokenizer, make_tiny_llama


class FakeLibrary:
    """Stands for the compiled extension module: the AVX2 path, no VNNI, a decoder step."""

    DecoderStep = object

    @staticmethod
    def cpu_isa() -> str:
        return "avx2"

    @staticmethod
    def fast_numerics_supported() -> bool:
        return False


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    # an empty ragspec cache and no kernel switches from the caller's environment
    monkeypatch.setenv("RAGSPEC_CACHE", str(tmp_path / "cache"))
    for name in (
        "RAGSPEC_CPU_KERNELS",
        "RAGSPEC_NATIVE_STEP",
        "RAGSPEC_CPU_ISA",
        "RAGSPEC_NUMERICS",
        "RAGSPEC_DRAFTING",
    ):
        monkeypatch.delenv(name, raising=False)


def _doctor_json(capsys, *args: str) -> tuple[int, dict]:
    rc = cli.main(["doctor", "--json", *args])
    return rc, json.loads(capsys.readouterr().out)


def test_doctor_kernels_active(monkeypatch, capsys):
    # a loaded library (the loader monkeypatched): active, its ISA, nothing to explain
    monkeypatch.setattr(kernels, "_load_module_why", lambda cache_dir=None, build=True: (FakeLibrary, None, "active"))
    rc, report = _doctor_json(capsys, "--require-kernels")
    assert rc == 0
    k = report["cpu_kernels"]
    assert (k["active"], k["state"], k["reason"], k["isa"], k["decoder_step"]) == (True, "active", None, "avx2", True)
    assert k["missing_sources"] == []
    # without --model nothing is loaded: the native step is not judged
    assert report["native_step"]["runs"] is None and report["model"] is None
    assert report["numerics"] == {
        "requested": "exact",
        "fast_available": False,
        "fast_reason": report["numerics"]["fast_reason"],
    }
    assert "VNNI" in report["numerics"]["fast_reason"]
    assert report["drafting"]["requested"] == "auto" and report["drafting"]["resolved"] in ("retrieval", "merged")
    assert report["versions"]["torch"] is not None and report["versions"]["transformers"] is not None
    assert report["cache"]["kernel_dir"].startswith(str(Path(report["cache"]["cache_dir"]) / "kernels"))
    assert set(report["cuda"]) >= {"backend_available", "reason", "device_present"}


def test_doctor_kernels_refused_sources_missing(monkeypatch, capsys, caplog, tmp_path):
    # an installation that lost a kernel source (issue 40's wheel): refused, the file named,
    # the loader's warning logged, --require-kernels fails
    monkeypatch.setattr(kernels, "_cpu_supported", lambda: True)
    monkeypatch.setattr(kernels, "_HASHED", (*kernels._HASHED, tmp_path / "gone.cpp"))
    with caplog.at_level(logging.WARNING, logger="ragspec.backend.cpu.kernels"):
        rc, report = _doctor_json(capsys, "--require-kernels")
    assert rc == 1
    k = report["cpu_kernels"]
    assert (k["active"], k["state"], k["missing_sources"]) == (False, "sources_missing", ["gone.cpp"])
    assert "gone.cpp" in k["reason"] and "missing" in k["reason"]
    assert report["cache"]["kernel_dir"] is None  # no hash without every source
    assert report["numerics"]["fast_reason"] == "needs the compiled CPU kernels"
    assert any("sources are missing" in r.getMessage() for r in caplog.records)


def test_doctor_kernels_switched_off(monkeypatch, capsys):
    monkeypatch.setenv("RAGSPEC_CPU_KERNELS", "0")
    monkeypatch.setattr(kernels, "_load_module_why", lambda *a, **k: pytest.fail("switched off: nothing is loaded"))
    rc, report = _doctor_json(capsys)
    assert rc == 0
    assert report["cpu_kernels"]["state"] == "disabled"
    assert "RAGSPEC_CPU_KERNELS=0" in report["cpu_kernels"]["reason"]


def test_doctor_kernels_refused_no_compiler(monkeypatch, capsys):
    # an empty cache and no compiler on PATH: refused, saying so
    monkeypatch.setattr(kernels, "_cpu_supported", lambda: True)
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    rc, report = _doctor_json(capsys)
    assert rc == 0
    assert report["cpu_kernels"]["state"] == "no_compiler"
    assert "ninja" in report["cpu_kernels"]["reason"]


def test_doctor_kernels_refused_compile_error(monkeypatch, capsys):
    # the build fails: the compiler's first line is the reason
    def failing_build(final):
        raise RuntimeError("error building extension 'ragspec_cpu_kernels'\nmore lines")

    monkeypatch.setattr(kernels, "_cpu_supported", lambda: True)
    monkeypatch.setattr(kernels.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(kernels, "_build", failing_build)
    rc, report = _doctor_json(capsys)
    assert report["cpu_kernels"]["state"] == "compile_error"
    assert report["cpu_kernels"]["reason"] == "compiling failed: error building extension 'ragspec_cpu_kernels'"


def test_doctor_no_build_does_not_compile(monkeypatch, capsys):
    # --no-build only looks: an empty cache reads "not_built", the compiler is never called
    monkeypatch.setattr(kernels, "_cpu_supported", lambda: True)
    monkeypatch.setattr(kernels, "_build", lambda final: pytest.fail("--no-build compiled"))
    rc, report = _doctor_json(capsys, "--no-build")
    assert report["cpu_kernels"]["state"] == "not_built"


def test_doctor_text_says_why_not(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(kernels, "_cpu_supported", lambda: True)
    monkeypatch.setattr(kernels, "_HASHED", (*kernels._HASHED, tmp_path / "gone.cpp"))
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "CPU kernels:  NOT active (sources_missing)" in out and "gone.cpp" in out


def _tiny_folder(path: Path, head_dim: int) -> Path:
    model = make_tiny_llama(head_dim=head_dim)
    model.save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    return path


def test_doctor_model_native_step_runs(tmp_path, capsys, monkeypatch):
    # a tiny Llama the native step runs (head_dim 32), through the real kernels
    if not _BUILDABLE:
        pytest.skip("this machine cannot build the kernel (needs Linux x86-64 with AVX2, a C++ compiler and ninja)")
    monkeypatch.delenv("RAGSPEC_CACHE")  # the kernels built once for the whole test run
    folder = _tiny_folder(tmp_path / "tiny", head_dim=32)
    rc, report = _doctor_json(capsys, "--model", str(folder), "--device", "cpu")
    assert rc == 0 and report["cpu_kernels"]["active"]
    assert report["native_step"]["runs"] is True and report["native_step"]["reason"] is None
    assert report["model"]["backend"] == "NativeTarget" and report["model"]["dtype"] == "float32"
    assert report["numerics"]["fast_reason"] in (
        "needs a GGUF model",
        "needs a CPU with AVX-512 VNNI (and RAGSPEC_CPU_ISA not avx2)",
    )


def test_doctor_model_native_step_refused_with_reason(tmp_path, capsys, monkeypatch):
    # head_dim 8: the kernels load, the native step refuses this model and says why;
    # RAGSPEC_NATIVE_STEP=0 says so instead
    if not _BUILDABLE:
        pytest.skip("this machine cannot build the kernel (needs Linux x86-64 with AVX2, a C++ compiler and ninja)")
    monkeypatch.delenv("RAGSPEC_CACHE")
    folder = _tiny_folder(tmp_path / "tiny8", head_dim=8)
    rc, report = _doctor_json(capsys, "--model", str(folder), "--device", "cpu")
    assert report["cpu_kernels"]["active"] and report["native_step"]["runs"] is False
    assert "head_dim 8" in report["native_step"]["reason"]
    monkeypatch.setenv("RAGSPEC_NATIVE_STEP", "0")
    rc, report = _doctor_json(capsys, "--model", str(folder), "--device", "cpu")
    assert report["native_step"] == {
        "enabled": False,
        "in_library": True,
        "runs": False,
        "reason": "switched off: RAGSPEC_NATIVE_STEP=0",
    }


def test_doctor_model_kernels_refused_native_step_says_so(tmp_path, capsys, monkeypatch):
    # sources missing: the model loads on torch's kernels, the native step names the cause
    monkeypatch.setattr(kernels, "_cpu_supported", lambda: True)
    monkeypatch.setattr(kernels, "_HASHED", (*kernels._HASHED, tmp_path / "gone.cpp"))
    folder = _tiny_folder(tmp_path / "tiny", head_dim=32)
    rc, report = _doctor_json(capsys, "--model", str(folder), "--device", "cpu")
    assert report["cpu_kernels"]["state"] == "sources_missing"
    assert report["native_step"]["runs"] is False
    assert "not available" in report["native_step"]["reason"]


def test_model_info_json_carries_the_kernels(tmp_path, capsys, monkeypatch):
    # model info --json: the model's facts plus doctor's under "kernels" for that model
    monkeypatch.setattr(
        kernels, "_load_module_why", lambda cache_dir=None, build=True: (None, "no, for the test", "compile_error")
    )
    folder = _tiny_folder(tmp_path / "tiny", head_dim=32)
    assert cli.main(["model", "info", "--model", str(folder), "--device", "cpu", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_parameters"] > 0
    k = info["kernels"]
    assert k["cpu_kernels"] == {
        "active": False,
        "state": "compile_error",
        "reason": "no, for the test",
        "isa": None,
        "fast_numerics": False,
        "decoder_step": False,
        "missing_sources": [],
    }
    assert k["model"]["backend"] == "CPUTarget" and k["native_step"]["runs"] is False
    assert k["drafting"]["device"] == "cpu" and k["drafting"]["resolved"] == "retrieval"
    assert k["model"]["dtype"] == "float32"


@pytest.mark.parametrize(
    "torch_cuda, device, triton, reason",
    [
        (None, False, False, "CPU-only build"),
        ("12.8", False, False, "no CUDA device visible"),
        ("12.8", True, False, "triton is not installed"),
    ],
)
def test_cuda_reason_names_the_missing_device_or_cpu_torch_first(monkeypatch, torch_cuda, device, triton, reason):
    """Regression: on a CPU-only torch, ``ragspec doctor`` gave "triton is not installed" as
    the reason the CUDA backend is not available."""
    import torch

    from ragspec.backend.cuda import kernels as cuda_kernels
    from ragspec.cli import doctor

    monkeypatch.delenv("RAGSPEC_CUDA_BACKEND", raising=False)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "a GPU")
    monkeypatch.setattr(cuda_kernels, "triton_available", lambda: triton)
    facts = doctor._cuda_facts(None)
    assert facts["backend_available"] is False
    assert reason in facts["reason"], facts


def test_doctor_device_cuda_without_cuda_reports_the_reason(monkeypatch, capsys):
    """Regression: ``ragspec doctor --device cuda`` (docs/gpu.md's install check) on a
    machine without CUDA stopped with "device 'cuda' asked for but CUDA is not available"
    instead of reporting why the CUDA backend is not there (a CPU-only torch, no device)."""
    import torch

    monkeypatch.delenv("RAGSPEC_CUDA_BACKEND", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(kernels, "_load_module_why", lambda cache_dir=None, build=True: (FakeLibrary, None, "active"))
    rc, report = _doctor_json(capsys, "--device", "cuda")
    assert rc == 0
    assert report["cuda"]["backend_available"] is False
    assert "CPU-only build" in report["cuda"]["reason"]
    assert report["drafting"]["device"] == "cuda"
    # with --model nothing can be loaded there: one error line that says why
    assert cli.main(["doctor", "--device", "cuda", "--model", "any-model"]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and "CPU-only build" in err
