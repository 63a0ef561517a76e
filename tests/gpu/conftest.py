"""The GPU tests: ragspec on CUDA, correct first (float32, TF32 off), then CUDA's own paths.

Every test here runs on ``RAGSPEC_TEST_DEVICE`` (default ``cuda``) in
``RAGSPEC_TEST_DTYPE`` (default ``fp32``) and is skipped when that device is CUDA and no
CUDA device is present (CI, the 2-core CPU). ``RAGSPEC_TEST_DEVICE=cpu`` runs the same
tests on the CPU (a rehearsal of the tests themselves, as ``scripts/gpu_check.sh`` does
with ``DEVICE=cpu``); tests marked ``cuda_only`` (they check what only CUDA does: fused
attention kernels, device-dependent defaults, CUDA logits) skip there.
"""

from __future__ import annotations

import pytest
import torch
from gpu_testing import DEVICE_ENV, test_device_name, test_dtype_name


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda_only: checks a CUDA-only behaviour (skipped on other test devices)")
    config.addinivalue_line(
        "markers", "torch_compile: compiles with torch.compile on CUDA (a minute cold; a short device check skips it)"
    )


def _test_device() -> torch.device:
    name = test_device_name()
    try:
        return torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise pytest.UsageError(f"{DEVICE_ENV}={name!r} is not a torch device: {e}") from e


def pytest_runtest_setup(item):
    """Skip before any fixture is set up (a module-scoped real engine included): without
    the test device, and ``cuda_only`` tests off CUDA."""
    dev = _test_device()
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"no CUDA device (set {DEVICE_ENV}=cpu to rehearse these tests on the CPU)")
    if item.get_closest_marker("cuda_only") is not None and dev.type != "cuda":
        pytest.skip(f"checks a CUDA-only behaviour; the test device is {dev}")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return _test_device()


@pytest.fixture(scope="session", autouse=True)
def _one_cpu_thread(device):
    """On a CPU rehearsal, one intra-op thread: these models are small, and on a shared
    2-core machine two threads per op spin against other processes (a 32 x 64 linear took
    10 ms instead of 0.05 under load)."""
    if device.type != "cpu":
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def dtype() -> torch.dtype:
    from ragspec.models import resolve_dtype

    return resolve_dtype(test_dtype_name(), None)


@pytest.fixture(autouse=True)
def no_tf32():
    """float32 matrix products and convolutions in full float32 (no TF32) for each test."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old[0], old[1]
    torch.set_float32_matmul_precision(old[2])


@pytest.fixture
def float32_only(dtype):
    """Token identity is promised in float32 only (bfloat16 rounds a multi-row forward
    differently from a one-row one): such tests skip under another test dtype."""
    if dtype != torch.float32:
        pytest.skip(f"token identity is promised in float32; the test dtype is {dtype}")
