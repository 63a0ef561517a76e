"""Linear weights read from GGUF blocks (ragspec/quant.py, quant_linear in the compiled kernel).

The tiny models here are quantized in the test with gguf-py (the library transformers loads
GGUF files with) and written to a real GGUF file with its ``GGUFWriter``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernels import _BUILDABLE

from ragspec.backend.cpu.build import read_gguf_blocks
from ragspec.backend.cpu.kernels import load_quant_linear
from ragspec.backend.cpu.quant import (
    Q4_1,
    Q6_K,
    Q8_0,
    GGUFWeight,
    load_gguf_weights,
    match_gguf_weights,
    read_gguf_weights,
)
from ragspec.backend.cpu.target import CPUTarget
from ragspec.types import DraftTree
from ragspec_testing import greedy_reference, make_tiny_llama, make_tree, random_k_blocks


@pytest.fixture(scope="module")
def kernels():
    if not _BUILDABLE:
        pytest.skip("this machine cannot build the kernel (needs Linux x86-64 with AVX2, a C++ compiler and ninja)")
    from ragspec.backend.cpu.kernels import load_skinny_linear

    skinny, quant = load_skinny_linear(), load_quant_linear()
    assert skinny is not None and quant is not None, "the kernel failed to build on a machine that can build it"
    return skinny, quant


def _qtype(fmt):
    from gguf import GGMLQuantizationType

    return {Q4_1: GGMLQuantizationType.Q4_1, Q8_0: GGMLQuantizationType.Q8_0, "Q5_0": GGMLQuantizationType.Q5_0}[fmt]


def _quantize(w: torch.Tensor, fmt) -> tuple[np.ndarray, torch.Tensor]:
    """gguf-py's quantization of ``w`` [O, I] (``fmt``: Q4_1, Q8_0 or "Q5_0"): (raw block
    bytes uint8 [O, bytes per row], gguf-py's de-quantization float32 [O, I])."""
    from gguf import quants

    qtype = _qtype(fmt)
    raw = quants.quantize(w.detach().numpy().astype(np.float32), qtype)
    return raw, torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32))


@pytest.mark.parametrize("fmt", [Q4_1, Q8_0, "Q5_0"])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (13, 32), (1536, 576)])
def test_quant_linear_equals_the_float32_kernel_bit_for_bit(kernels, fmt, out_features, in_features):
    skinny, quant = kernels
    gen = torch.Generator().manual_seed(out_features + len(str(fmt)))
    raw, deq = _quantize(torch.randn(out_features, in_features, generator=gen) * 0.05, fmt)
    q = GGUFWeight.from_blocks(raw, fmt, in_features)
    assert torch.equal(q.dequantize(), deq)  # our de-quantization is gguf-py's, exactly
    bias = torch.randn(out_features, generator=gen)
    for rows in (1, 2, 3, 4, 5, 8, 16, 17):
        x = torch.randn(rows, in_features, generator=gen)
        assert torch.equal(quant(x, q.qs, q.scales, q.fmt, None), skinny(x, deq, None))
        assert torch.equal(quant(x, q.qs, q.scales, q.fmt, bias), skinny(x, deq, bias))


@pytest.mark.parametrize("kind,fmt", [("Q4_K", Q4_1), ("Q6_K", Q6_K)])
@pytest.mark.parametrize("out_features,in_features", [(96, 256), (13, 1024), (640, 2048)])
def test_k_formats_read_to_gguf_py_values_and_the_float32_kernel_bit_for_bit(
    kernels, kind, fmt, out_features, in_features
):
    """Q4_K (kept as Q4_1) and Q6_K (int8, a scale per 16): the de-quantization is gguf-py's
    exactly, and quant_linear equals skinny_linear over it bit for bit (gemma3-270m's
    attention outputs and MLP down projections, in-features 1024 and 2048)."""
    skinny, quant = kernels
    gen = torch.Generator().manual_seed(out_features + in_features + len(kind))
    raw, deq = random_k_blocks(out_features, in_features, kind, gen)
    q = GGUFWeight.from_blocks(raw, kind, in_features)
    assert q.fmt == fmt and q.well_formed() and q.shape == (out_features, in_features)
    assert torch.equal(q.dequantize(), deq)  # gguf-py's values, exactly
    bias = torch.randn(out_features, generator=gen)
    for rows in (1, 2, 3, 4, 5, 8, 16, 17):
        x = torch.randn(rows, in_features, generator=gen)
        assert torch.equal(quant(x, q.qs, q.scales, q.fmt, None), skinny(x, deq, None)), rows
        assert torch.equal(quant(x, q.qs, q.scales, q.fmt, bias), skinny(x, deq, bias)), rows


def test_quant_linear_rejects_bad_shapes(kernels):
    _, quant = kernels
    raw, _ = _quantize(torch.randn(8, 64), Q4_1)
    q = GGUFWeight.from_blocks(raw, Q4_1, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quant(torch.randn(1, 48), q.qs, q.scales, Q4_1, None)
    with pytest.raises(RuntimeError, match="qs shape"):
        quant(torch.randn(1, 64), q.qs, q.scales, Q8_0, None)  # Q4_1 bytes read as Q8_0
    with pytest.raises(RuntimeError, match="fmt"):
        quant(torch.randn(1, 64), q.qs, q.scales, 7, None)
    raw, _ = _quantize(torch.randn(8, 64), Q8_0)
    q = GGUFWeight.from_blocks(raw, Q8_0, 64)
    with pytest.raises(RuntimeError, match="scales shape"):
        quant(torch.randn(1, 64), q.qs, q.scales, Q6_K, None)  # one scale per 32 read as one per 16


def _quantized_tiny_model(path, *, permute: str, perturb: str, layers: int = 2):
    """A tiny Llama whose linear weights are gguf-py round trips (Q4_1; the value
    projections Q5_0; the tied output layer Q8_0), written to a GGUF at ``path``. The rows of ``permute`` are stored
    shuffled in the file (as llama.cpp stores query/key projections); ``perturb`` is
    changed in the model after writing, so the file no longer holds it."""
    from gguf import GGUFWriter

    model = make_tiny_llama(layers=layers)
    writer = GGUFWriter(str(path), "llama")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        named = {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        for name, weight in named.items():
            fmt = Q8_0 if name == "lm_head" else "Q5_0" if name.endswith("v_proj") else Q4_1
            raw, deq = _quantize(weight, fmt)
            weight.copy_(deq)
            if name == permute:
                raw = raw[torch.randperm(raw.shape[0], generator=gen).numpy()]
            writer.add_tensor(name, raw, raw_dtype=_qtype(fmt))
        # a tensor in another format and a 1-D one: skipped
        writer.add_tensor("norm", np.ones(32, dtype=np.float32))
        writer.add_tensor("f16", np.zeros((4, 32), dtype=np.float16))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        named[perturb][0, 0] += 1e-3
    return model, named


def test_gguf_weights_are_matched_by_content_rows_permuted_or_not(tmp_path):
    model, named = _quantized_tiny_model(
        tmp_path / "m.gguf", permute="model.layers.0.self_attn.q_proj", perturb="model.layers.1.mlp.down_proj"
    )
    candidates = read_gguf_weights(tmp_path / "m.gguf")
    assert len(candidates) == len(named)  # the float32 and float16 tensors are skipped
    matched = match_gguf_weights(candidates, named)
    assert set(matched) == set(named) - {"model.layers.1.mlp.down_proj"}
    assert matched["lm_head"].fmt == Q8_0 and matched["model.layers.0.self_attn.q_proj"].fmt == Q4_1
    assert matched["model.layers.0.self_attn.v_proj"].fmt == Q8_0  # Q5_0 in the file, read as int8
    for name, q in matched.items():  # every match, the permuted one included, is exact
        assert torch.equal(q.dequantize(), named[name].detach())


def test_k_format_tensors_are_read_and_matched_rows_permuted_or_not(tmp_path):
    """A GGUF holding Q4_K and Q6_K tensors (as gemma3-270m's Q4_K_M file: attention
    outputs, MLP down projections): every one is read, matched exactly (rows shuffled in
    the file or not), saved to and read back from the block cache."""
    from gguf import GGMLQuantizationType, GGUFWriter

    path, cache = tmp_path / "k.gguf", tmp_path / "blocks.safetensors"
    gen = torch.Generator().manual_seed(5)
    writer = GGUFWriter(str(path), "llama")
    weights: dict[str, torch.Tensor] = {}
    for name, kind, (rows, cols) in [
        ("o_proj", "Q4_K", (64, 512)),
        ("o_proj_permuted", "Q4_K", (64, 512)),
        ("down_proj", "Q6_K", (48, 768)),
        ("down_proj_permuted", "Q6_K", (48, 768)),
    ]:
        raw, deq = random_k_blocks(rows, cols, kind, gen)
        weights[name] = deq
        if name.endswith("permuted"):
            raw = raw[torch.randperm(rows, generator=gen).numpy()]
        writer.add_tensor(name, raw, raw_dtype=getattr(GGMLQuantizationType, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert len(read_gguf_weights(path)) == 4
    for _ in range(2):  # matched from the file, then read from the cache it wrote
        matched = load_gguf_weights(path, weights, cache)
        assert set(matched) == set(weights) and cache.is_file()
        assert {n: q.fmt for n, q in matched.items()} == {
            "o_proj": Q4_1,
            "o_proj_permuted": Q4_1,
            "down_proj": Q6_K,
            "down_proj_permuted": Q6_K,
        }
        for name, q in matched.items():
            assert q.well_formed() and torch.equal(q.dequantize(), weights[name])


def test_greedy_through_gguf_weights_is_bit_identical(tmp_path, kernels):
    """The forwards read 13 of the 15 linear weights from GGUF blocks (one was permuted in
    the file, one is no longer in it) and give the same logits bit for bit as the float32
    kernel, and greedy output equal to transformers'."""
    skinny, quant = kernels
    path = tmp_path / "m.gguf"
    model, named = _quantized_tiny_model(
        path, permute="model.layers.0.self_attn.k_proj", perturb="model.layers.0.mlp.up_proj"
    )
    calls: list[int] = []

    def counting(x, qs, scales, fmt, bias):
        calls.append(int(x.shape[0]))
        return quant(x, qs, scales, fmt, bias)

    blocks = read_gguf_blocks(model, path, counting)
    assert len(blocks.weights) == len(named) - 1 and blocks.numerics == "exact"
    target = CPUTarget(model, skinny=skinny, gguf=blocks)
    assert target.gguf_weights == len(named) - 1
    plain = CPUTarget(
        _quantized_tiny_model(tmp_path / "copy.gguf", permute="", perturb="model.layers.0.mlp.up_proj")[0],
        skinny=skinny,
    )
    prompt = list(range(5, 17))
    tree = make_tree([8, 9, 10, 11], [-1, 0, 1, 0], source="test")
    with torch.inference_mode():
        a, b = target.new_state(), plain.new_state()
        target.prefill(a, prompt)
        plain.prefill(b, prompt)
        calls.clear()
        for t in (tree, DraftTree.empty()):
            fa = target.verify_one(a, 7, t)
            fb = plain.verify_one(b, 7, t)
            assert torch.equal(fa.logits, fb.logits)
        # 5 rows: 13 decoder weights and the output layer, then the plain step
        assert calls.count(5) == 13 + 1 and calls.count(1) == 13 + 1
        model.generate(torch.tensor([prompt]), max_new_tokens=2, do_sample=False)  # transformers' own path
    assert calls.count(5) == 14 and calls.count(1) == 14

    from ragspec.config import PLDConfig
    from ragspec.drafters import PromptLookupDrafter
    from ragspec.engine import Engine
    from ragspec_testing import make_char_tokenizer

    tok = make_char_tokenizer()
    engine = Engine(target, tok, drafter=PromptLookupDrafter(PLDConfig()), eos_token_ids=[2])
    ids = tok("the cat sat on the mat. the cat sat on the mat. the cat")["input_ids"]
    out = engine.generate(ids, max_new_tokens=40)
    assert list(out.token_ids) == greedy_reference(model, ids, 40, eos_token_id=2)


def test_gguf_block_cache_is_reused_and_rebuilt_when_corrupt_or_stale(tmp_path, monkeypatch):
    import ragspec.backend.cpu.quant as quant_mod

    path, cache = tmp_path / "m.gguf", tmp_path / "cache" / "blocks.safetensors"
    model, named = _quantized_tiny_model(path, permute="lm_head", perturb="model.layers.0.mlp.gate_proj")
    first = load_gguf_weights(path, named, cache)
    assert cache.is_file() and len(first) == len(named) - 1

    reads: list[str] = []
    real_read = quant_mod.read_gguf_weights
    monkeypatch.setattr(quant_mod, "read_gguf_weights", lambda p: reads.append(str(p)) or real_read(p))
    again = load_gguf_weights(path, named, cache)
    assert reads == [] and set(again) == set(first)  # from the cache, the GGUF not parsed
    assert all(torch.equal(again[n].qs, first[n].qs) for n in first)

    cache.write_bytes(cache.read_bytes()[:100])  # a truncated cache: matched from the GGUF again
    assert set(load_gguf_weights(path, named, cache)) == set(first) and len(reads) == 1

    with torch.no_grad():  # weights changed since the cache was written: it is not trusted
        named["model.layers.1.self_attn.o_proj"][1, 2] += 1e-3
    stale = load_gguf_weights(path, named, cache)
    assert len(reads) == 2 and set(stale) == set(first) - {"model.layers.1.self_attn.o_proj"}


def test_gguf_weights_are_a_no_op_without_the_kernel_or_for_other_dtypes(tmp_path):
    path = tmp_path / "m.gguf"
    model, _ = _quantized_tiny_model(path, permute="", perturb="lm_head")
    assert read_gguf_blocks(model, path, None) is None
    assert read_gguf_blocks(model.to(torch.bfloat16), path, lambda *a: None) is None


def test_unreadable_gguf_keeps_the_float32_weights_with_a_warning(tmp_path, caplog):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 64)
    with caplog.at_level("WARNING", logger="ragspec.backend.cpu.build"):
        assert read_gguf_blocks(make_tiny_llama(layers=1), path, lambda *a: None) is None
    assert "cannot read GGUF blocks" in caplog.text


def test_gguf_block_cache_of_an_older_ragspec_is_rebuilt(tmp_path, monkeypatch):
    """A cache written before a format was supported (Q5_0 came after Q4_1/Q8_0) holds
    fewer matches, all still exact: it must be rebuilt, not trusted, or the newly read
    weights would never be used."""
    import ragspec.backend.cpu.quant as quant_mod

    path, cache = tmp_path / "m.gguf", tmp_path / "blocks.safetensors"
    _, named = _quantized_tiny_model(path, permute="", perturb="model.layers.0.mlp.gate_proj")
    monkeypatch.setattr(quant_mod, "_CACHE_FORMAT", "ragspec-gguf-blocks-older")
    older = {n: q for n, q in load_gguf_weights(path, named, cache).items() if not n.endswith("v_proj")}
    quant_mod._save_cached(cache, older)  # what a ragspec without Q5_0 would have cached
    monkeypatch.undo()
    assert set(load_gguf_weights(path, named, cache)) == set(older) | {
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.v_proj",
    }


@pytest.mark.parametrize("damage", ["format code", "qs dtype", "scales dtype", "scales shape"])
def test_gguf_block_cache_with_values_right_but_types_wrong_is_rebuilt(tmp_path, damage):
    """Regression (fresh-user trial): a cache whose de-quantized values still equal the
    weights but whose format code, dtypes or shapes the kernel refuses passed the load-time
    check, and every later load crashed in the kernel. Such a cache is now rebuilt."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path, cache = tmp_path / "m.gguf", tmp_path / "blocks.safetensors"
    _, named = _quantized_tiny_model(path, permute="", perturb="model.layers.0.mlp.gate_proj")
    good = load_gguf_weights(path, named, cache)
    with safe_open(str(cache), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    if damage == "format code":
        meta["lm_head"] = "7"
    elif damage == "qs dtype":  # same values, another integer type
        tensors["model.layers.0.self_attn.q_proj.qs"] = tensors["model.layers.0.self_attn.q_proj.qs"].to(torch.int16)
    elif damage == "scales dtype":
        tensors["lm_head.scales"] = tensors["lm_head.scales"].double()
    else:
        tensors["lm_head.scales"] = tensors["lm_head.scales"].reshape(-1, 1).contiguous()
    save_file(tensors, str(cache), metadata=meta)
    rebuilt = load_gguf_weights(path, named, cache)
    assert set(rebuilt) == set(good) and all(q.well_formed() for q in rebuilt.values())
    assert all(q.well_formed() for q in load_gguf_weights(path, named, cache).values())  # the rewritten cache


def test_gguf_block_cache_is_readable_by_other_users(tmp_path):
    """Regression (fresh-user trial): the cache file came out mode 0600 (safetensors writes
    a new file, so the mode set on the temporary file was lost)."""
    path, cache = tmp_path / "m.gguf", tmp_path / "blocks.safetensors"
    _, named = _quantized_tiny_model(path, permute="", perturb="lm_head")
    load_gguf_weights(path, named, cache)
    assert cache.stat().st_mode & 0o777 == 0o644
