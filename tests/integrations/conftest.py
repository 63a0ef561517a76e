"""Fixtures of the integration tests: an engine on the tiny random Llama with the character
tokenizer (plus a chat template), and a live uvicorn server on a free loopback port."""

from __future__ import annotations

import pytest
from _integ_helpers import CHAT_TEMPLATE, LiveServer, make_char_tokenizer, make_tiny_engine, make_tiny_llama


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
def tiny_folder(tmp_path_factory):
    """The tiny random Llama and the character tokenizer (with a chat template) saved as an
    HF folder, for tests that load a model by path (the CLI, served processes)."""
    tok = make_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3, eos_token_id=None).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def live_server(tiny_engine):
    """The app on the tiny engine, no API key, served on loopback."""
    from ragspec.integrations.server import ServerSettings, create_app

    app = create_app(engine=tiny_engine, settings=ServerSettings(max_active=8, max_queue=32))
    with LiveServer(app) as srv:
        yield srv


@pytest.fixture
def corpus(tmp_path, tiny_engine):
    """A datastore folder ``kb`` (one document) that knows nothing of the tiny model's answers."""
    from ragspec.datastore import build_datastore

    src = tmp_path / "seed.txt"
    src.write_text("a bird sang in the tree while the sun rose over the hill.")
    build_datastore([src], tmp_path / "kb", tiny_engine.tokenizer, progress=False)
    return tmp_path / "kb"
