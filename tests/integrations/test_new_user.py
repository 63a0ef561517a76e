"""What a new user trips on, run through ``ragspec.cli.main`` on a tiny random model: every
path and option of ``ragspec serve`` checked before the model loads, the API keys as users
write them, the datastore commands' messages."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RAGSPEC_CPU_KERNELS", "0")
    monkeypatch.setenv("RAGSPEC_CACHE", str(tmp_path / "cache"))
    for var in ("RAGSPEC_API_KEY", "RAGSPEC_DATASTORES", "RAGSPEC_MODEL", "RAGSPEC_EAGLE", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)


def _run(capsys, *argv) -> tuple[int, str, str]:
    from ragspec.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if the server starts loading anything."""
    import ragspec.serving

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    for name in ("load_serving", "load_serving_engine", "datastore_engines"):
        monkeypatch.setattr(ragspec.serving, name, loaded)


@pytest.mark.parametrize(
    "case, extra, named",
    [
        ("missing datastore", ["--datastore", "docs=nope-ds"], "'docs'"),
        ("file as datastore", ["--datastore", "docs={file}"], "'docs'"),
        ("folder that is no datastore", ["--datastore", "docs={folder}"], "manifest.json"),
        ("missing EAGLE head", ["--eagle", "{folder}"], "EAGLE head"),
        ("bad device", ["--device", "gpu0"], "gpu0"),
        ("bad dtype", ["--dtype", "int3"], "int3"),
        ("fast numerics on a transformers folder", ["--numerics", "fast", "--device", "cpu"], "GGUF"),
    ],
)
def test_serve_with_a_bad_path_or_option_fails_before_the_model_loads(
    tiny_folder, tmp_path, capsys, no_load, case, extra, named
):
    """Regression: ``ragspec serve --datastore docs=nope-ds`` failed after the model had
    loaded (91 s on a loaded machine) while ``/health`` answered 200."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty").mkdir()
    extra = [a.format(file=tmp_path / "a-file", folder=tmp_path / "empty") for a in extra]
    rc, _, err = _run(capsys, "serve", "--model", str(tiny_folder), "--no-calibrate", "--port", "8799", *extra)
    err = err.strip()
    assert rc == 2, err
    assert err.startswith("ragspec: error: ") and named in err, err
    assert len(err.splitlines()) == 1 and "internal error" not in err


def test_serve_with_a_missing_model_fails_before_loading(tmp_path, capsys, no_load):
    rc, _, err = _run(capsys, "serve", "--model", str(tmp_path / "no-model"), "--port", "8799")
    assert rc == 2 and "no-model" in err and "internal error" not in err


def test_check_inputs_passes_a_good_configuration(tiny_folder, tmp_path):
    from ragspec.datastore import build_datastore
    from ragspec.integrations.settings import ServerSettings
    from ragspec.models import load_tokenizer, resolve_model

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 20)
    build_datastore([corpus], tmp_path / "ds", load_tokenizer(resolve_model(str(tiny_folder))), progress=False)
    settings = ServerSettings(model=str(tiny_folder), device="cpu", datastores=(("docs", str(tmp_path / "ds")),))
    settings.check_inputs()  # nothing raised, nothing loaded


@pytest.mark.parametrize("flags", [["--api-key", "K1", "--api-key", "K2"], ["--api-key", "K1,K2"]])
def test_repeated_api_key_keeps_every_key(tiny_engine, flags):
    """Regression: ``--api-key K1 --api-key K2`` kept only the last key and locked the first
    tenant out."""
    import httpx
    from _integ_helpers import LiveServer

    from ragspec.cli import build_parser
    from ragspec.integrations.cli import settings_from_args
    from ragspec.integrations.server import create_app

    settings = settings_from_args(build_parser().parse_args(["serve", *flags]))
    assert settings.api_keys == ("K1", "K2")
    with LiveServer(create_app(engine=tiny_engine, settings=settings)) as srv:
        for key, status in (("K1", 200), ("K2", 200), ("K3", 401)):
            r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == status, (key, r.text)


def test_metrics_name_the_datastore_routes(tmp_path, tiny_engine):
    """Regression: ``/metrics`` counted the datastore routes as ``endpoint="other"``."""
    import re

    import httpx
    from _integ_helpers import LiveServer

    from ragspec.datastore import build_datastore
    from ragspec.integrations.server import ServerSettings, create_app

    corpus = tmp_path / "a.txt"
    corpus.write_text("the cat sat on the mat. " * 20)
    build_datastore([str(corpus)], tmp_path / "ds", tiny_engine.tokenizer, progress=False)
    app = create_app(engine=tiny_engine, settings=ServerSettings(datastores=(("notes", str(tmp_path / "ds")),)))
    with LiveServer(app) as srv:
        assert httpx.get(srv.url + "/v1/datastores").status_code == 200
        r = httpx.post(srv.url + "/v1/datastores/notes/documents", json={"documents": ["a dog ran."]}, timeout=60)
        assert r.status_code == 200, r.text
        httpx.get(srv.url + "/no-such-path")
        text = httpx.get(srv.url + "/metrics").text
    counted = dict(re.findall(r'^ragspec_requests_total\{endpoint="([^"]+)",status="(\d+)"\}', text, re.M))
    assert counted.get("/v1/datastores") == "200", text
    assert counted.get("/v1/datastores/{name}/documents") == "200", text
    assert counted.get("other") == "404", text


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("the cat sat on the mat. " * 20)
    return folder


@pytest.mark.parametrize("what", ["datastore", "folder", "file"])
def test_build_into_an_existing_output_says_what_is_there(tiny_folder, tmp_path, corpus, capsys, what):
    """Regression: ``datastore build -o X`` said "already exists (use add to extend a
    datastore, or overwrite)" whether X was a datastore, a folder or a file."""
    out = tmp_path / "out"
    model = ["--model", str(tiny_folder), "--no-progress"]
    if what == "datastore":
        assert _run(capsys, "datastore", "build", str(corpus), "-o", str(out), *model)[0] == 0
    elif what == "folder":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    else:
        out.write_text("mine")
    rc, _, err = _run(capsys, "datastore", "build", str(corpus), "-o", str(out), *model)
    assert rc == 2, err
    said = {"datastore": "is already a datastore", "folder": "is a folder of other files", "file": "is a file"}[what]
    assert said in err and "--overwrite" in err, err
    rc, _, err = _run(capsys, "datastore", "build", str(corpus), "-o", str(out), "--overwrite", *model)
    if what == "file":  # a file is never replaced
        assert rc == 2 and out.read_text() == "mine", err
    else:
        assert rc == 0 and (out / "manifest.json").is_file(), err


def test_info_verify_says_what_was_verified(tiny_folder, tmp_path, corpus, capsys):
    """Regression: ``datastore info --verify`` printed nothing of the verification."""
    import json

    out = tmp_path / "ds"
    rc, built, _ = _run(
        capsys, "datastore", "build", str(corpus), "-o", str(out), "--model", str(tiny_folder), "--no-progress"
    )
    assert rc == 0
    # the build summary says what each time measures, and the one info shows is there
    rc, text, _ = _run(capsys, "datastore", "info", str(out), "--verify")
    build_time = next(line for line in text.splitlines() if line.startswith("build time"))
    seconds = build_time.split()[2]
    assert f"({seconds} s tokenizing, indexing and writing" in built and "loading the tokenizer" in built, built
    assert "tokenizing, indexing and writing" in build_time
    verified = next(line for line in text.splitlines() if line.startswith("verified"))
    assert "sha256 of 4 files in 1 shard" in verified and "token ids" in verified, text
    rc, text, _ = _run(capsys, "datastore", "info", str(out), "--verify", "--json")
    info = json.loads(text)
    assert info["verified"] == {
        "files": 4,
        "shards": 1,
        "token_ids": info["num_tokens"],
        "vocab_size": info["vocab_size"],
    }
    rc, text, _ = _run(capsys, "datastore", "info", str(out), "--json")
    assert json.loads(text)["verified"] is False


def test_unsupported_langchain_calls_name_what_and_where(tiny_engine):
    """Regression: LangChain's unsupported calls raised an empty ``NotImplementedError``
    (``ChatRagspec.bind_tools`` did, before tools were supported); the one left,
    ``RagspecLLM.with_structured_output``, names itself and what to use instead."""
    from ragspec.errors import UnsupportedError
    from ragspec.integrations.langchain import RagspecLLM

    llm = RagspecLLM(engine=tiny_engine, max_new_tokens=2)
    with pytest.raises(UnsupportedError) as caught:
        llm.with_structured_output({"type": "object"})
    message = str(caught.value)
    assert isinstance(caught.value, NotImplementedError)  # as LangChain's own unsupported calls
    assert "RagspecLLM.with_structured_output" in message and "not supported" in message, message
    assert "ChatRagspec.with_structured_output" in message and "docs/usage.md" in message, message


def test_rag_chain_example_needs_no_langchain_community(monkeypatch):
    """Regression: ``examples/rag_chain.py`` printed langchain-community's sunset warning;
    its retriever is faiss behind a langchain-core retriever now, and the ``examples``
    extra does not bring langchain-community."""
    import importlib.util
    import sys
    from pathlib import Path

    import tomllib
    from langchain_core.embeddings import Embeddings

    root = Path(__file__).resolve().parents[2]
    monkeypatch.setitem(sys.modules, "langchain_community", None)  # importing it would fail
    spec = importlib.util.spec_from_file_location("ragspec_example_rag_chain_nc", root / "examples" / "rag_chain.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    class Letters(Embeddings):
        def embed_documents(self, texts):
            return [[t.count(c) / max(len(t), 1) for c in "abcdefghij"] for t in texts]

        def embed_query(self, text):
            return self.embed_documents([text])[0]

    docs = [example.Document(page_content=t) for t in ("aaaa", "bbbb", "cccc")]
    retriever, name = example.make_retriever(docs, Letters(), k=1)
    assert name == "faiss" and [d.page_content for d in retriever.invoke("bbb")] == ["bbbb"]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any("langchain-community" in req for req in extras["examples"])


@pytest.mark.parametrize("command", [["generate", "hello"], ["summarize", "{file}"]])
def test_generate_with_a_missing_datastore_fails_before_the_model_loads(
    tiny_folder, tmp_path, capsys, monkeypatch, command
):
    """``generate --datastore nope`` loaded the model first (seconds to minutes), then failed."""
    import ragspec.loading

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(ragspec.loading, "load_engine", loaded)
    (tmp_path / "doc.txt").write_text("a document")
    argv = [a.format(file=tmp_path / "doc.txt") for a in command]
    rc, _, err = _run(capsys, *argv, "--datastore", str(tmp_path / "nope"), "--model", str(tmp_path / "nope"))
    assert rc == 2 and "nope" in err and "internal error" not in err, err
    rc, _, err = _run(capsys, *argv, "--datastore", str(tmp_path / "nope"), "--model", str(tiny_folder))
    assert rc == 2 and "no datastore at" in err, err


def test_the_served_scheduler_settings_are_logged_at_start(tiny_engine, caplog):
    """A new user could not tell which --throughput-slack a running server used: the
    start-up log now names the scheduler's settings, and the worker uses that slack."""
    import logging

    import httpx
    from _integ_helpers import LiveServer

    from ragspec.integrations.server import ServerSettings, create_app

    with caplog.at_level(logging.INFO, logger="ragspec.integrations.server.app"):
        app = create_app(engine=tiny_engine, settings=ServerSettings(throughput_slack=0.3))
        with LiveServer(app) as srv:
            assert httpx.get(srv.url + "/ready").status_code == 200
            assert app.state.scheduler.composer.config.throughput_slack == 0.3
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("scheduler: ")]
    assert len(lines) == 1 and "throughput_slack=0.3" in lines[0], lines
