"""The GPU deployment files: ``Dockerfile.cuda`` and the compose override
``docker-compose.gpu.yml``, validated like ``docker-compose.yml`` in test_deploy.py (against
the vendored Compose Specification schema; these machines cannot run Docker)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml

from ragspec.cli import build_parser
from ragspec.integrations.cli import settings_from_args
from ragspec.integrations.settings import ServerSettings
from ragspec.models import resolve_dtype

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = Path(__file__).resolve().parent / "data" / "compose_spec.json"


def _validator():
    checker = jsonschema.FormatChecker()

    @checker.checks("duration")
    def _duration(value) -> bool:  # compose durations: 1h30m, 15s, 500ms
        return not isinstance(value, str) or re.fullmatch(r"(\d+(\.\d+)?(us|ms|s|m|h))+", value) is not None

    return jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()), format_checker=checker)


def merge(base, override):
    """Compose's merge of an override file, for what these files use: mappings merge key by
    key, any other value (lists of devices, commands) is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = copy.deepcopy(base)
        for k, v in override.items():
            out[k] = merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    return copy.deepcopy(override)


def dockerfile(path: str) -> str:
    return re.sub(r"\\\n\s*", " ", (ROOT / path).read_text())


def instruction(text: str, name: str) -> str:
    found = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith(name + " ")]
    assert found, f"no {name}"
    return found[-1].strip()


@pytest.fixture(scope="module")
def files():
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())
    return base, gpu, merge(base, gpu)


def test_gpu_override_and_merged_file_follow_the_compose_spec(files):
    base, gpu, merged = files
    v = _validator()
    for doc in (gpu, merged):
        errors = list(v.iter_errors(doc))
        assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]
    # a misspelt reservation is caught (the check is not vacuous)
    broken = merge(gpu, {"services": {"api": {"deploy": {"resources": {"reservations": {"devices": [{"gpus": 1}]}}}}}})
    assert list(v.iter_errors(broken))


def test_api_reserves_one_nvidia_gpu_and_runs_the_cuda_image(files):
    base, gpu, merged = files
    api = merged["services"]["api"]
    assert api["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    assert api["image"] == merged["services"]["model-fetch"]["image"] == "ragspec:cuda"
    assert merged["services"]["model-fetch"]["build"]["dockerfile"] == "Dockerfile.cuda"
    assert (ROOT / merged["services"]["model-fetch"]["build"]["dockerfile"]).is_file()
    # the rest of the service (command, ports, volumes, health check) is the CPU file's
    for key in ("command", "ports", "volumes", "healthcheck", "depends_on"):
        assert api[key] == base["services"]["api"][key]
    assert api["environment"]["RAGSPEC_CACHE"] == base["services"]["api"]["environment"]["RAGSPEC_CACHE"]


def test_cuda_image_serves_the_same_command_on_cuda(files, monkeypatch):
    cpu, cuda = dockerfile("Dockerfile"), dockerfile("Dockerfile.cuda")
    for name in ("CMD", "HEALTHCHECK", "EXPOSE", "VOLUME", "USER"):
        assert instruction(cuda, name) == instruction(cpu, name)
    env = instruction(cuda, "ENV").replace(" ", "")
    assert "RAGSPEC_DEVICE=cuda" in env and "RAGSPEC_CACHE=/data/cache" in env
    # the compose environment reaches the server's settings: device cuda, bf16 by default
    api = files[2]["services"]["api"]
    for k, v in api["environment"].items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.delenv("RAGSPEC_DTYPE", raising=False)
    monkeypatch.delenv("RAGSPEC_API_KEY", raising=False)
    args = build_parser().parse_args(json.loads(instruction(cuda, "CMD"))[1:])
    settings = settings_from_args(args)
    assert isinstance(settings, ServerSettings)
    assert settings.device == "cuda" and settings.dtype is None
    assert resolve_dtype(settings.dtype, settings.device) == torch.bfloat16
