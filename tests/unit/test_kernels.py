"""The compiled few-row linear kernel (ragspec/backend/cpu/csrc/linear.cpp) and where it is used.

The kernel is built on first use (~45 s, cached under ~/.cache/ragspec/kernels). Where the
machine cannot build it (no AVX2, no compiler or ninja) the tests that need it are skipped
with that reason; on a machine that should build it, a failed build fails the test."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from ragspec.backend.cpu import kernels
from ragspec.backend.cpu.build import CPUSpeedUps, load_cpu_target
from ragspec.backend.cpu.kernels import (
    SKINNY_MAX_ROWS,
    _cpu_supported,
    cpu_kernels_enabled,
    kernel_dir,
    load_skinny_linear,
)
from ragspec.backend.cpu.target import CPUTarget
from ragspec.types import DraftTree
from ragspec_testing import greedy_reference, make_tiny_llama, make_tree

_BUILDABLE = _cpu_supported() and bool(shutil.which(os.environ.get("CXX", "c++"))) and bool(shutil.which("ninja"))


@pytest.fixture(scope="module")
def skinny():
    if not _BUILDABLE:
        pytest.skip("this machine cannot build the kernel (needs Linux x86-64 with AVX2, a C++ compiler and ninja)")
    kernel = load_skinny_linear()
    assert kernel is not None, "the kernel failed to build on a machine that has AVX2, a compiler and ninja"
    return kernel


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 17])
@pytest.mark.parametrize("in_features,out_features", [(64, 96), (13, 7), (576, 33)])
def test_skinny_linear_matches_f_linear(skinny, rows, in_features, out_features):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen)
    torch.testing.assert_close(skinny(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(skinny(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    # a non-contiguous input is copied, not misread
    xt = torch.randn(in_features, rows, generator=gen).t()
    torch.testing.assert_close(skinny(xt, w, None), F.linear(xt, w), rtol=1e-5, atol=1e-4)


def test_skinny_linear_rejects_wrong_shapes_and_dtypes(skinny):
    with pytest.raises(RuntimeError, match="shape mismatch"):
        skinny(torch.randn(2, 8), torch.randn(4, 9), None)
    with pytest.raises(RuntimeError, match="float32 only"):
        skinny(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64), None)


class _CountingKernel:
    """Stands in for the compiled kernel: F.linear, counting calls by row count."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, x, w, b):
        self.rows.append(int(x.shape[0]))
        return F.linear(x, w, b)


def test_kernel_runs_only_inside_the_targets_own_forwards():
    model = make_tiny_llama(layers=2)
    kernel = _CountingKernel()
    target = CPUTarget(model, skinny=kernel)
    assert target.packed_linears == 2 * 7
    assert target.skinny is kernel
    ids = torch.tensor([[5, 9, 12, 40]])
    with torch.inference_mode():
        model(ids)  # the user's (and model.generate's) forwards: transformers' kernels
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
        assert kernel.rows == []
        state = target.new_state()
        target.prefill(state, list(range(3, 3 + SKINNY_MAX_ROWS + 4)))  # prefill longer than the kernel's rows
        assert kernel.rows == [1]  # the output layer's one row; the decoder's 20 rows took torch's kernel
        kernel.rows.clear()
        target.verify_one(state, 7, make_tree([8, 9, 10], [-1, 0, 1], source="test"))
        # 7 linear layers x 2 decoder layers at 4 rows, then the output layer
        assert kernel.rows == [4] * 14 + [4]
        kernel.rows.clear()
        target.verify_one(state, 7, DraftTree.empty())  # a plain step
        assert kernel.rows == [1] * 15


def test_greedy_through_the_compiled_kernel_matches_generate(skinny):
    from ragspec.config import PLDConfig
    from ragspec.drafters import PromptLookupDrafter
    from ragspec.engine import Engine
    from ragspec_testing import make_char_tokenizer

    tok = make_char_tokenizer()
    target = CPUTarget(make_tiny_llama(layers=2), skinny=skinny)
    engine = Engine(target, tok, drafter=PromptLookupDrafter(PLDConfig()), eos_token_ids=[2])
    prompt = tok("the cat sat on the mat. the cat sat on the mat. the cat")["input_ids"]
    out = engine.generate(prompt, max_new_tokens=40)
    assert out.stats.num_drafted_tokens > 0
    assert list(out.token_ids) == greedy_reference(make_tiny_llama(layers=2), prompt, 40, eos_token_id=2)


def test_kernel_switch_off_by_argument_and_environment(monkeypatch):
    from ragspec.loading import select_target

    target = select_target(make_tiny_llama(layers=1), cpu_kernels=False)
    assert target.skinny is None and target.attention_kernel is None
    monkeypatch.setenv("RAGSPEC_CPU_KERNELS", "0")
    assert not cpu_kernels_enabled()
    by_env = select_target(make_tiny_llama(layers=1))
    assert by_env.skinny is None
    monkeypatch.setenv("RAGSPEC_CPU_KERNELS", "")
    assert cpu_kernels_enabled()
    assert cpu_kernels_enabled("1") and not cpu_kernels_enabled("off")
    # other dtypes keep torch's kernels
    half = load_cpu_target(make_tiny_llama(layers=1).to(torch.bfloat16), CPUSpeedUps(compiled_kernels=True))
    assert half.skinny is None


def test_kernel_build_failure_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    if not _cpu_supported():
        pytest.skip("the build is only attempted on Linux x86-64 with AVX2")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.INFO, logger="ragspec.backend.cpu.kernels"):
        assert load_skinny_linear(tmp_path / "kernels") is None
    assert "no C++ compiler" in caplog.text
    # a compiler that fails: the error is logged and torch's kernels stay in use
    broken = tmp_path / "broken-c++"
    broken.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    if not shutil.which("ninja"):
        pytest.skip("ninja is needed to attempt a build")
    with caplog.at_level(logging.WARNING, logger="ragspec.backend.cpu.kernels"):
        assert load_skinny_linear(tmp_path / "kernels2") is None
    assert "compiled CPU kernel unavailable" in caplog.text


def _fake_build(real_so, calls):
    """Stands in for torch's ``cpp_extension.load``: 'builds' by copying the real library
    into the build folder it is given (which must be fresh: no other build's lock)."""

    def load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        calls.append(build_directory)
        assert not any(os.scandir(build_directory)), "a build must start in its own empty folder"
        shutil.copy(real_so, os.path.join(build_directory, f"{name}.so"))
        return kernels._import_built(real_so)

    return load


def test_killed_kernel_build_does_not_block_later_loads(skinny, tmp_path, monkeypatch):
    """Regression (fresh-user trial): a build killed by SIGTERM/SIGKILL left torch's
    ``lock`` file in the shared build folder and every later start waited on it forever.
    Builds now run in private folders and move the library into place."""
    real_so = kernel_dir() / f"{kernels._NAME}.so"
    target = kernel_dir(tmp_path)
    target.parent.mkdir(parents=True)
    stale = target.parent / f"{target.name}.build-killed"
    stale.mkdir()
    (stale / "lock").touch()
    os.utime(stale, (0, 0))  # long ago
    fresh = target.parent / f"{target.name}.build-running"
    fresh.mkdir()
    (fresh / "lock").touch()  # a build killed a moment ago (or still running)
    calls: list[str] = []
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "load", _fake_build(real_so, calls))
    kernel = load_skinny_linear(tmp_path)
    assert kernel is not None and len(calls) == 1
    assert (target / f"{kernels._NAME}.so").is_file()
    assert not stale.exists() and fresh.exists()  # only stale leftovers are removed
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    torch.testing.assert_close(kernel(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_cached_kernel_loads_without_the_build_system(skinny, tmp_path, monkeypatch):
    """Regression (fresh-user trial): loading a built kernel went through torch's build
    step, which takes a write lock (a read-only cache fell back to torch's kernels) and
    rebuilt whenever another checkout had used the cache. A cached library is imported
    directly."""
    target = kernel_dir(tmp_path)
    target.mkdir(parents=True)
    shutil.copy(kernel_dir() / f"{kernels._NAME}.so", target / f"{kernels._NAME}.so")
    import torch.utils.cpp_extension as cpp

    def no_build(*args, **kwargs):
        raise AssertionError("the cached kernel must load without building")

    monkeypatch.setattr(cpp, "load", no_build)
    kernel = load_skinny_linear(tmp_path)
    assert kernel is not None
    x, w = torch.randn(3, 24), torch.randn(5, 24)
    torch.testing.assert_close(kernel(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
    # the folder is keyed by the source and flags, not by the checkout
    assert kernel_dir(tmp_path) == target and target.name.startswith(f"torch-{torch.__version__.replace('+', '-')}")


def test_corrupt_cached_kernel_is_rebuilt(skinny, tmp_path, monkeypatch, caplog):
    """Regression (fresh-user trial): a corrupt cached library made every later start fall
    back to torch's kernels (the build system thought it up to date). It is rebuilt once."""
    real_so = kernel_dir() / f"{kernels._NAME}.so"
    target = kernel_dir(tmp_path)
    target.mkdir(parents=True)
    (target / f"{kernels._NAME}.so").write_bytes(os.urandom(1000))
    calls: list[str] = []
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "load", _fake_build(real_so, calls))
    with caplog.at_level(logging.WARNING, logger="ragspec.backend.cpu.kernels"):
        kernel = load_skinny_linear(tmp_path)
    assert kernel is not None and len(calls) == 1
    assert "does not load" in caplog.text
    assert (target / f"{kernels._NAME}.so").read_bytes() == real_so.read_bytes()


def test_bf16_model_on_a_cpu_without_bf16_packing_does_not_crash():
    """Regression (fresh-user trial): ``--dtype bf16`` on a CPU without oneDNN's bfloat16
    support crashed packing the linears ("bf16 path needs the cpu support ..."): packing is
    skipped there and the model decodes with torch's kernels."""
    from ragspec.backend.cpu.fastpaths import _mkldnn_bf16_supported, can_pack
    from ragspec.config import PLDConfig
    from ragspec.drafters import PromptLookupDrafter
    from ragspec.engine import Engine
    from ragspec_testing import make_char_tokenizer

    tok = make_char_tokenizer()
    target = CPUTarget(
        make_tiny_llama(layers=1).to(torch.bfloat16),
        pack_linears=True,
        skinny=load_skinny_linear() if _BUILDABLE else None,
    )
    assert can_pack(target.device, torch.bfloat16) == _mkldnn_bf16_supported()
    assert target.packed_linears == (7 if _mkldnn_bf16_supported() else 0)
    assert target.skinny is None  # float32 only
    engine = Engine(target, tok, drafter=PromptLookupDrafter(PLDConfig()), eos_token_ids=[])
    out = engine.generate(tok("the cat sat on the mat. the cat")["input_ids"], max_new_tokens=12)
    assert len(out.token_ids) == 12


# ---------------------------------------------------------------------------------------
# the few-query attention kernel (same library)


@pytest.fixture(scope="module")
def attention(skinny):
    kernel = kernels.load_few_query_attention()
    assert kernel is not None
    return kernel


def _sdpa(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("q_len", [1, 2, 5, 16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (32, 4, 4), (128, 4, 1)])
@pytest.mark.parametrize("keys", [19, 64, 65, 200])
def test_few_query_attention_matches_sdpa(attention, q_len, head_dim, heads, kv_heads, keys):
    gen = torch.Generator().manual_seed(q_len * 7919 + head_dim + keys)
    # the query as transformers hands it over ([1, Q, H, d] transposed), keys and values as
    # views of a larger cache buffer (ragspec's growable cache)
    q = torch.randn(1, q_len, heads, head_dim, generator=gen).transpose(1, 2)
    kbuf = torch.randn(1, kv_heads, keys + 37, head_dim, generator=gen)
    vbuf = torch.randn(1, kv_heads, keys + 37, head_dim, generator=gen)
    k, v = kbuf[:, :, :keys], vbuf[:, :, :keys]
    # a draft tree's mask: every cached key, then the tree's own ancestors (holes included)
    mask = torch.ones(1, 1, q_len, keys, dtype=torch.bool)
    mask[..., keys - q_len :] = torch.rand(q_len, q_len, generator=gen).tril() > 0.4
    mask[..., keys - q_len :] |= torch.eye(q_len, dtype=torch.bool)
    if keys > q_len + 2:
        mask[0, 0, 0, : keys - q_len - 1] = False  # a row that sees only its last cached key
    scale = head_dim**-0.5
    torch.testing.assert_close(attention(q, k, v, mask, scale), _sdpa(q, k, v, mask, scale), rtol=1e-5, atol=1e-5)
    if q_len == 1:  # one-token decoding: no mask, every key
        torch.testing.assert_close(attention(q, k, v, None, 0.3), _sdpa(q, k, v, None, 0.3), rtol=1e-5, atol=1e-5)


def test_few_query_attention_rejects_what_it_does_not_compute(attention):
    q, k = torch.randn(1, 4, 2, 64), torch.randn(1, 2, 10, 64)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        attention(torch.randn(1, 4, 2, 48), torch.randn(1, 2, 10, 48), torch.randn(1, 2, 10, 48), None, 1.0)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        attention(torch.randn(1, 3, 2, 64), k, k, None, 1.0)  # 3 query heads over 2 key/value heads
    with pytest.raises(RuntimeError, match="float32 queries, float32 or float16 keys"):
        attention(q.double(), k.double(), k.double(), None, 1.0)
    with pytest.raises(RuntimeError, match="float32 queries, float32 or float16 keys"):
        attention(q, k.half(), k, None, 1.0)  # keys and values of different dtypes
    with pytest.raises(RuntimeError, match="float32 queries, float32 or float16 keys"):
        attention(q.half(), k.half(), k.half(), None, 1.0)
    with pytest.raises(RuntimeError, match="mask must be"):
        attention(q, k, k, torch.ones(1, 1, 2, 9, dtype=torch.bool), 1.0)


class _CountingAttention:
    """Stands in for the compiled attention: SDPA, counting calls by query count."""

    def __init__(self) -> None:
        self.queries: list[int] = []

    def __call__(self, q, k, v, mask, scale):
        self.queries.append(int(q.shape[2]))
        return _sdpa(q, k, v, mask, scale).contiguous()


def test_attention_kernel_runs_only_inside_the_targets_own_forwards():
    model = make_tiny_llama(layers=2, head_dim=32)
    kernel = _CountingAttention()
    target = CPUTarget(model, attention_kernel=kernel, route_attention=True)
    assert target.attention_routed and target.attention_kernel is kernel
    ids = torch.tensor([[5, 9, 12, 40]])
    with torch.inference_mode():
        model(ids)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
        assert kernel.queries == []
        state = target.new_state()
        target.prefill(state, list(range(3, 23)))  # a prompt chunk within the parts budget
        assert kernel.queries == [20, 20]
        target.verify_one(state, 7, make_tree([8, 9, 10], [-1, 0, 0], source="test"))  # a tree
        target.rollback(state, 20)
        target.verify_one(state, 7, DraftTree.chain([8, 9]))  # a chain (transformers' causal mask)
        target.verify_one(state, 7, DraftTree.empty())  # a plain step
        assert kernel.queries == [20, 20, 4, 4, 3, 3, 1, 1]  # 2 layers each
    # built without it (the attention still routed): torch's SDPA
    without = CPUTarget(make_tiny_llama(layers=2, head_dim=32), route_attention=True)
    with torch.inference_mode():
        state = without.new_state()
        without.prefill(state, list(range(3, 23)))
        without.verify_one(state, 7, DraftTree.empty())
        assert kernel.queries == [20, 20, 4, 4, 3, 3, 1, 1]


def test_a_prefill_chunk_past_the_parts_budget_takes_sdpa(monkeypatch):
    """A prompt chunk's attention runs the kernel only while its per-key-block partial
    results fit PREFILL_ATTENTION_PARTS_BYTES (past it the kernel runs slower than SDPA)."""
    from ragspec.backend.cpu import fastpaths

    model = make_tiny_llama(layers=2, head_dim=32)
    kernel = _CountingAttention()
    target = CPUTarget(model, attention_kernel=kernel, route_attention=True)
    # 20 queries x 4 heads x 1 key block x 32 dims x 4 bytes = 10240 bytes of partial results
    monkeypatch.setattr(fastpaths, "PREFILL_ATTENTION_PARTS_BYTES", 10240 - 1)
    with torch.inference_mode():
        state = target.new_state()
        target.prefill(state, list(range(3, 23)))
        assert kernel.queries == []
        target.verify_one(state, 7, DraftTree.empty())  # few rows: always the kernel
        assert kernel.queries == [1, 1]
        monkeypatch.setattr(fastpaths, "PREFILL_ATTENTION_PARTS_BYTES", 10240)
        state = target.new_state()
        target.prefill(state, list(range(3, 23)))
        assert kernel.queries == [1, 1, 20, 20]


def test_greedy_through_the_attention_kernel_matches_generate(skinny, attention):
    from ragspec_testing import assert_scripted_drafts_keep_greedy, make_char_tokenizer

    tok = make_char_tokenizer()
    prompt = tok("the cat sat on the mat. the cat sat on the mat. the cat")["input_ids"]
    ref = greedy_reference(make_tiny_llama(layers=2, head_dim=32, eos_token_id=None), prompt, 60)
    target = CPUTarget(
        make_tiny_llama(layers=2, head_dim=32, eos_token_id=None),
        skinny=skinny,
        attention_kernel=attention,
        route_attention=True,
    )
    assert target.attention_routed
    # drafts the true continuation (accepted 8-token chains) / wrong tokens (rejected): both
    # verified through the kernel, every draft verified (no cost model in the way)
    assert_scripted_drafts_keep_greedy(target, tok, prompt, ref, 96)


def test_the_builder_builds_the_target_with_both_compiled_kernels(skinny, attention):
    target = load_cpu_target(make_tiny_llama(layers=1, head_dim=32), CPUSpeedUps(native_step=False))
    assert target.skinny is skinny and target.attention_kernel is attention
    plain = load_cpu_target(make_tiny_llama(layers=1, head_dim=32), CPUSpeedUps(compiled_kernels=False))
    assert plain.skinny is None and plain.attention_kernel is None


def test_q8_0_quantization_rounds_each_block_to_its_scale():
    """quantize_q8_0 (a drafter's own weights as Q8_0 blocks): per 32 weights d = max|w| /
    127 and q = round(w / d), so each weight is off by d / 2 at most; an all-zero block
    stays zero; other shapes are refused."""
    from ragspec.backend.cpu.quant import Q8_0, quantize_q8_0

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 96, generator=gen)
    w[3, 32:64] = 0.0
    q = quantize_q8_0(w)
    assert q.fmt == Q8_0 and q.well_formed() and q.shape == (24, 96)
    d = q.scales[..., None]  # [24, 3, 1]
    back = (q.qs.reshape(24, 3, 32).float() * d).reshape(24, 96)
    assert torch.all((back - w).abs() <= d.expand(24, 3, 32).reshape(24, 96) / 2 + 1e-7)
    assert torch.equal(back[3, 32:64], torch.zeros(32))
    assert int(q.qs.abs().max()) == 127
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.randn(4, 40))


def test_missing_kernel_sources_fall_back_with_one_warning(monkeypatch, tmp_path, caplog):
    """Regression (issue 40, a non-editable install): the wheel carried none of csrc/, and the
    kernel loader crashed with FileNotFoundError while hashing the sources for its cache key,
    before its documented fallback. Now: one warning that names the missing files, torch's
    kernels, and the model runs (greedy unchanged)."""
    if not _cpu_supported():
        pytest.skip("the kernels are only looked for on Linux x86-64 with AVX2")
    gone = tmp_path / "site-packages" / "csrc"  # an installed package without its sources
    monkeypatch.setattr(kernels, "_CSRC", gone)
    monkeypatch.setattr(kernels, "_SOURCES", tuple(gone / p.name for p in kernels._SOURCES))
    monkeypatch.setattr(kernels, "_HASHED", tuple(gone / p.name for p in kernels._HASHED))
    assert kernels.missing_sources() == [p.name for p in kernels._HASHED]
    cache = tmp_path / "cache"
    with caplog.at_level(logging.DEBUG, logger="ragspec.backend.cpu.kernels"):
        target = load_cpu_target(make_tiny_llama(layers=1), CPUSpeedUps(cache=cache))
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert "sources are missing" in message and "linear.cpp" in message and "torch's kernels are used" in message
    assert type(target) is CPUTarget and target.skinny is None and not cache.exists()  # no build attempted
    prompt = [5, 9, 13, 9, 13, 9]
    assert list(_greedy(target, prompt, 8)) == greedy_reference(make_tiny_llama(layers=1), prompt, 8, eos_token_id=2)


def _greedy(target, prompt, steps, eos=2):
    """Plain greedy decoding through ``target``: the prompt but its last token prefilled, then
    one verification of an empty draft a token (the last one as the root)."""
    out: list[int] = []
    with torch.inference_mode():
        state = target.new_state()
        target.prefill(state, prompt[:-1])
        token = prompt[-1]
        for _ in range(steps):
            past = state.length
            token = int(target.verify_one(state, token, DraftTree.empty()).logits[0].argmax())
            target.commit(state, past, [])
            out.append(token)
            if token == eos:
                break
    return out


def test_kernel_build_compiles_and_hashes_every_csrc_file(tmp_path, monkeypatch):
    """The build compiles every .cpp of csrc/ and its cache key covers every .cpp and .h, so a
    changed file (a header too) builds anew."""
    csrc = kernels._CSRC
    assert {p.name for p in kernels._SOURCES} == {p.name for p in csrc.glob("*.cpp")}
    assert {p.name for p in kernels._HASHED} == {p.name for p in csrc.iterdir() if p.suffix in (".cpp", ".h")}
    copy = tmp_path / "csrc"
    shutil.copytree(csrc, copy)
    monkeypatch.setattr(kernels, "_HASHED", tuple(copy / p.name for p in kernels._HASHED))
    before = kernel_dir(tmp_path)
    assert before == kernel_dir(tmp_path)  # stable
    for name in ("linear_tiles.h", "attention.cpp"):
        path = copy / name
        path.write_text(path.read_text() + "\n// changed\n")
        after = kernel_dir(tmp_path)
        assert after != before
        before = after


def test_a_maskless_prompt_chunk_attends_causally_through_the_kernel(attention):
    """transformers hands a first prompt chunk over without a mask (causal, as many keys as
    queries): the kernel gets the causal mask, so its values are those of the explicit
    mask, bit for bit, and agree with SDPA's causal attention to float32 rounding."""
    from ragspec.backend.cpu.fastpaths import compiled_attention, kernel_attention_applies

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 40, 64, generator=g)
    k = torch.randn(1, 3, 40, 64, generator=g)
    v = torch.randn(1, 3, 40, 64, generator=g)
    routed = compiled_attention(attention)
    with torch.inference_mode():
        assert kernel_attention_applies(q, k, None, 0.0, {})
        # without a mask, only a chunk with as many keys as queries is known to be causal
        assert not kernel_attention_applies(q, k[:, :, :39], None, 0.0, {})
        out = routed.run(q, k, v, None, 0.125)  # [1, Q, Hq, d]
        causal = torch.ones(40, 40, dtype=torch.bool).tril()[None, None]
        assert torch.equal(out, attention(q, k, v, causal, 0.125))
        kk, vv = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
        ref = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=0.125).transpose(1, 2)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
