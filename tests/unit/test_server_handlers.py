"""The server's handlers are module-level functions a test imports and calls: directly with
a :class:`ServerState`, or through their router on a bare FastAPI app whose state
dependency is overridden (FastAPI's way), with no ``create_app`` and no lifespan. A tiny
random Llama with the character tokenizer serves them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from ragspec import Engine, PolicyConfig
from ragspec.backend.hf import HFTarget
from ragspec.drafters import PromptLookupDrafter
from ragspec.integrations.metrics import ServerMetrics
from ragspec.integrations.server import errors, openai, ops, summarize
from ragspec.integrations.server.errors import APIError
from ragspec.integrations.server.prepare import prepare_completion
from ragspec.integrations.server.state import ServerState, check_datastore, check_model, server_state
from ragspec.integrations.settings import ServerSettings
from ragspec.integrations.stepper import Stepper
from ragspec.params import RequestParams

PROMPT = "the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def engine(tiny_model, char_tokenizer, single_thread) -> Engine:
    return Engine(
        HFTarget(tiny_model),
        char_tokenizer,
        drafter=PromptLookupDrafter(),
        policy=PolicyConfig(max_draft_tokens=4, adaptive=False),
        model_name="tiny-llama",
    )


@pytest.fixture
def state(engine):
    settings = ServerSettings(calibrate=False)
    scheduler = Stepper(engine, max_active=2, max_queue=2)
    scheduler.start()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    yield ServerState(
        settings=settings,
        metrics=ServerMetrics(),
        engine=engine,
        scheduler=scheduler,
        prepare_pool=pool,
        limits=settings.limits(engine.target.max_length),
        model_name="served-name",
        started=1234,
    )
    scheduler.stop()
    pool.shutdown()


def _app(state: ServerState) -> FastAPI:
    """The routers alone, the state given by a dependency override."""
    app = FastAPI()
    errors.install_error_handlers(app)
    app.include_router(openai.router, prefix="/v1")
    app.include_router(summarize.router, prefix="/v1")
    app.dependency_overrides[server_state] = lambda: state
    return app


def test_models_handler_called_directly(state):
    out = asyncio.run(openai.models(state))
    # the served name, the start time and no datastores, from the state given
    assert out["data"][0]["id"] == "served-name"
    assert out["data"][0]["created"] == 1234
    assert out["data"][0]["datastores"] == []


def test_completions_router_with_the_state_dependency_overridden(state, engine):
    with TestClient(_app(state)) as client:
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
    assert r.status_code == 200, r.text
    body = r.json()
    # greedy: the handler's text is the engine's own answer for the same prompt
    expected = engine.generate(PROMPT, chat=False, max_new_tokens=8).text
    assert body["choices"][0]["text"] == expected
    assert body["usage"]["completion_tokens"] == 8 and body["model"] == "served-name"
    assert state.scheduler.num_jobs == 0  # the job and its reserved place are released


def test_an_unknown_model_is_a_404_from_the_router(state):
    with TestClient(_app(state)) as client:
        r = client.post("/v1/summarize", json={"model": "other", "documents": ["a cat."]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_health_handler_called_directly():
    class _Request:  # what the handler reads: request.app.state.model_name
        class app:
            class state:
                model_name = "m"

    assert asyncio.run(ops.health(_Request())) == {"status": "ok", "model": "m"}


def test_state_checks_and_preparation_are_plain_functions(state, engine):
    check_model(state, "served-name")
    check_model(state, "tiny-llama")  # the engine's own name is accepted too
    with pytest.raises(APIError) as e:
        check_model(state, "gpt-4")
    assert e.value.status == 404
    check_datastore(state, None)  # none named: the default (here, no datastore)
    with pytest.raises(APIError) as e:
        check_datastore(state, "/etc")  # datastores are named, never paths
    assert e.value.code == "datastore_not_found"
    vocab = engine.target.vocab_size
    params = RequestParams(max_new_tokens=4)
    with pytest.raises(APIError, match="token ids must be in"):
        prepare_completion(engine, [1, vocab], params, state.limits, threading.Event())
    prepared = prepare_completion(engine, [1, 2, 3], params, state.limits, threading.Event())
    assert prepared.prompt_ids == (1, 2, 3) and prepared.document_ids == ()
