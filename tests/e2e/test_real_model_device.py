"""The real-model fixture runs where RAGSPEC_TEST_DEVICE / RAGSPEC_TEST_DTYPE say."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.real_model


def test_real_engine_runs_on_the_test_device_and_dtype(real_engine):
    from ragspec.models import resolve_dtype

    # the same defaults as tests/e2e/conftest.py
    want = torch.device(os.environ.get("RAGSPEC_TEST_DEVICE") or "cpu")
    assert real_engine.target.device.type == want.type
    assert real_engine.target.dtype == resolve_dtype(os.environ.get("RAGSPEC_TEST_DTYPE") or "fp32", want)
    assert next(real_engine.model.parameters()).device.type == want.type
