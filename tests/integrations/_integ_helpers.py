"""The root ``tests/conftest.py`` builders, loaded by file path.

``from conftest import ...`` is ambiguous once several test folders have a conftest.py
(pytest swaps ``sys.modules["conftest"]`` as it collects), so the integration tests import
the tiny-model builders from here instead."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import threading
import time
from pathlib import Path

_ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
_spec = importlib.util.spec_from_file_location("_ragspec_tests_root_conftest", _ROOT_CONFTEST)
_root = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_root)

make_char_tokenizer = _root.make_char_tokenizer
make_tiny_llama = _root.make_tiny_llama
greedy_reference = _root.greedy_reference
ScriptedDrafter = _root.ScriptedDrafter
oracle_plan = _root.oracle_plan

# a chat template the character tokenizer can spell (letters, digits, punctuation, newline)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
FLAT_LATENCY = {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.013, 16: 0.015}


def make_tiny_engine(eos=(), max_draft: int = 8, drafter=None):
    """An engine on the tiny random Llama (context 512 tokens) with prompt lookup drafting
    (or ``drafter``).

    No EOS by default, so every generation runs to ``max_new_tokens`` or a stop string. The
    draft policy is not adaptive, so drafts (and hence seeded samples) never depend on the
    latency model other requests update."""
    from ragspec import Engine, PolicyConfig
    from ragspec.backend.hf import HFTarget
    from ragspec.drafters import PromptLookupDrafter
    from ragspec.policy import LatencyModel

    tok = make_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3)
    return Engine(
        HFTarget(model),
        tok,
        drafter=drafter if drafter is not None else PromptLookupDrafter(),
        policy=PolicyConfig(max_draft_tokens=max_draft, adaptive=False),
        latency=LatencyModel(dict(FLAT_LATENCY)),
        eos_token_ids=eos,
        model_name="tiny-llama",
    )


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


__all__ = [
    "make_char_tokenizer",
    "make_tiny_llama",
    "greedy_reference",
    "ScriptedDrafter",
    "oracle_plan",
    "make_tiny_engine",
    "LiveServer",
    "free_port",
    "CHAT_TEMPLATE",
]
