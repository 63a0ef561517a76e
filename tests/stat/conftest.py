"""Settings shared by the distribution tests (helpers are in sampling_fit.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread):
    """Tiny tensors: every distribution test runs on one intra-op thread (tests/conftest.py)."""
    yield
