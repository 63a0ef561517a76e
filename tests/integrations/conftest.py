"""Fixtures of the integration tests: an engine on the tiny random Llama with the character
tokenizer (plus a chat template), and a live uvicorn server on a free loopback port."""

from __future__ import annotations

import pytest
from _integ_helpers import LiveServer, make_tiny_engine


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny tensors: one intra-op thread is faster than two (no hand-offs), and the CPU is
    shared."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_engine():
    return make_tiny_engine()


@pytest.fixture(scope="module")
def live_server(tiny_engine):
    """The app on the tiny engine, no API key, served on loopback."""
    from ragspec.integrations.server import ServerSettings, create_app

    app = create_app(engine=tiny_engine, settings=ServerSettings(max_active=8, max_queue=32))
    with LiveServer(app) as srv:
        yield srv
