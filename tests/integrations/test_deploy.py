"""Deployment files and the ``ragspec serve`` command line.

These machines cannot run Docker: ``docker-compose.yml`` is validated against the Compose
Specification's JSON schema (vendored in data/, see data/README.md), and the command the
image and the compose service run is checked to be the one tested here, which then runs for
real (in a thread) on a tiny model folder."""

from __future__ import annotations

import json
import os
import re
import shlex
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml
from _integ_helpers import CHAT_TEMPLATE, free_port, make_char_tokenizer, make_tiny_llama

from ragspec.cli import build_parser
from ragspec.errors import ConfigError
from ragspec.integrations.cli import settings_from_args
from ragspec.integrations.settings import ServerSettings, parse_datastore

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = Path(__file__).resolve().parent / "data" / "compose_spec.json"


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def dockerfile_instruction(name: str) -> str:
    """The argument of the last ``name`` instruction of the Dockerfile (continuations joined)."""
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n\s*", " ", text)
    found = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith(name + " ")]
    assert found, f"no {name} in the Dockerfile"
    return found[-1].strip()


def interpolate(value: str, env: dict) -> str:
    """Compose's ``${VAR}`` / ``${VAR:-default}`` interpolation (enough for this file)."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def test_compose_file_follows_the_compose_spec(compose):
    schema = json.loads(SCHEMA.read_text())
    checker = jsonschema.FormatChecker()

    @checker.checks("duration")
    def _duration(value) -> bool:  # compose durations: 1h30m, 15s, 500ms
        return not isinstance(value, str) or re.fullmatch(r"(\d+(\.\d+)?(us|ms|s|m|h))+", value) is not None

    errors = list(jsonschema.Draft7Validator(schema, format_checker=checker).iter_errors(compose))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]
    # and a broken file is caught (the check is not vacuous)
    broken = {"services": {"api": {"image": "x", "healthcheck": {"interval": "often"}, "bogus": 1}}}
    assert list(jsonschema.Draft7Validator(schema, format_checker=checker).iter_errors(broken))


def test_image_and_compose_run_the_tested_serve_command(compose):
    cmd = json.loads(dockerfile_instruction("CMD"))
    api = compose["services"]["api"]
    assert api["command"] == cmd
    assert cmd[:2] == ["ragspec", "serve"]
    # the command parses with the real CLI into the settings the container needs
    env = {k: interpolate(str(v), {}) for k, v in api["environment"].items()}  # nothing set by the user
    args = build_parser().parse_args(cmd[1:])
    assert args.func.__name__ == "cmd_serve"
    old = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        settings = settings_from_args(args)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert settings.host == "0.0.0.0"  # inside the container; published on 127.0.0.1 only
    assert settings.api_key is None  # RAGSPEC_API_KEY empty unless set when starting compose
    assert (settings.max_queue, settings.max_active) == (32, 8)
    # ports, health check, cache volume and scraping all point at what serve binds
    assert api["ports"] == [f"127.0.0.1:{settings.port}:{settings.port}"]
    # the container is healthy once the engine is loaded (/ready); /health is liveness only
    assert f":{settings.port}/ready" in " ".join(api["healthcheck"]["test"])
    assert f":{settings.port}/ready" in dockerfile_instruction("HEALTHCHECK")
    cache = api["environment"]["RAGSPEC_CACHE"]
    assert any(v.endswith(":" + cache) for v in api["volumes"])
    assert f"RAGSPEC_CACHE={cache}" in dockerfile_instruction("ENV").replace(" ", "")
    prom = yaml.safe_load((ROOT / "prometheus.yml").read_text())
    job = prom["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == [f"api:{settings.port}"]


def test_serve_options_and_environment(monkeypatch):
    parser = build_parser()
    monkeypatch.delenv("RAGSPEC_API_KEY", raising=False)
    s = settings_from_args(parser.parse_args(["serve"]))
    assert (s.host, s.port, s.api_key, s.datastores) == ("127.0.0.1", 8000, None, ())  # loopback by default
    monkeypatch.setenv("RAGSPEC_API_KEY", "from-env")
    monkeypatch.setenv("RAGSPEC_PORT", "9001")
    monkeypatch.setenv("RAGSPEC_DATASTORES", "wiki=/d/wiki,docs=/d/docs")
    s = settings_from_args(parser.parse_args(["serve"]))
    assert (s.api_key, s.port, s.datastores) == ("from-env", 9001, (("wiki", "/d/wiki"), ("docs", "/d/docs")))
    # options win over the environment
    s = settings_from_args(
        parser.parse_args(["serve", "--api-key", "cli", "--port", "9002", "--datastore", "a=/x", "--datastore", "/y/b"])
    )
    assert (s.api_key, s.port, s.datastores) == ("cli", 9002, (("a", "/x"), ("b", "/y/b")))
    assert parse_datastore("notes=/srv/ds/notes") == ("notes", "/srv/ds/notes")
    for bad in ("../x=/d", "=/d", "a=", "a b=/d"):
        with pytest.raises(ConfigError):
            parse_datastore(bad)
    with pytest.raises(ConfigError):
        ServerSettings(datastores=(("a", "/x"), ("a", "/y")))
    with pytest.raises(ConfigError):
        ServerSettings.from_env({"RAGSPEC_MAX_QUEUE": "many"})


def test_ragspec_serve_command_serves(tmp_path, monkeypatch):
    # the compose command, bound to loopback on a free port, on a tiny model folder: the
    # parser, the settings, the model loading and create_app all run for real; the
    # uvicorn server is recorded so that this test can stop it
    import uvicorn

    tok = make_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3)
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    port = free_port()
    args = json.loads(dockerfile_instruction("CMD"))[1:]
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    args += ["--model", str(folder), "--no-calibrate", "--max-queue", "4"]
    monkeypatch.setenv("RAGSPEC_API_KEY", "k3y")
    servers = []
    real_run = uvicorn.Server.run

    def run(self, sockets=None):
        servers.append(self)
        return real_run(self, sockets)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    parsed = build_parser().parse_args(args)
    thread = threading.Thread(target=parsed.func, args=(parsed,), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not (servers and servers[0].started):
            assert thread.is_alive(), "ragspec serve exited"
            assert time.monotonic() < deadline, "ragspec serve did not come up: ragspec " + shlex.join(args)
            time.sleep(0.05)
        assert servers[0].config.host == "127.0.0.1"
        assert httpx.get(url + "/health").status_code == 200  # at once, while the model loads
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.05)
        assert httpx.get(url + "/health").json()["model"] == "tiny"
        assert httpx.get(url + "/v1/models").status_code == 401
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
            headers={"Authorization": "Bearer k3y"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 5
    finally:
        if servers:
            servers[0].should_exit = True
        thread.join(20)
    assert not thread.is_alive()


def test_serve_with_a_bad_eagle_folder_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """Regression (fresh-user trial): ``ragspec serve --eagle /nonexistent`` (or a bad
    model or datastore) exited after a 30-line uvicorn lifespan traceback. The engine loads
    in the background while the server answers /health (issue 42); a load that fails stops
    the server: a one-line ``ragspec: error:`` and exit status 2."""
    import uvicorn

    from ragspec.cli import main

    tok = make_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    folder = tmp_path / "tiny"
    make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3).save_pretrained(folder)
    tok.save_pretrained(folder)
    capsys.readouterr()  # (the save's progress bar)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("uvicorn.run: not how serve runs"))
    rc = main(["serve", "--model", str(folder), "--no-calibrate", "--eagle", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert rc == 2
    # the progress lines of the load come first; the error is one line, the last, no traceback
    errors = [line for line in err.splitlines() if line.startswith("ragspec: error:")]
    assert len(errors) == 1 and err.rstrip().splitlines()[-1] == errors[0]
    assert "not an EAGLE head folder" in errors[0] and "Traceback" not in err
