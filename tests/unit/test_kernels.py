"""The compiled few-row linear kernel (ragspec/csrc/skinny_linear.cpp) and where it is used.

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

from ragspec.kernels import SKINNY_MAX_ROWS, _cpu_supported, cpu_kernels_enabled, load_skinny_linear
from ragspec.target import TargetModel
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
    target = TargetModel(model)
    assert target.prepack_linears(kernel) == 2 * 7
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
        target.verify_forward(state, 7, make_tree([8, 9, 10], [-1, 0, 1], source="test"))
        # 7 linear layers x 2 decoder layers at 4 rows, then the output layer
        assert kernel.rows == [4] * 14 + [4]
        kernel.rows.clear()
        target.verify_forward(state, 7, DraftTree.empty())  # a plain step
        assert kernel.rows == [1] * 15


def test_greedy_through_the_compiled_kernel_matches_generate(skinny):
    from ragspec.config import PLDConfig
    from ragspec.drafting import PromptLookupDrafter
    from ragspec.engine import Engine
    from ragspec_testing import make_char_tokenizer

    tok = make_char_tokenizer()
    target = TargetModel(make_tiny_llama(layers=2))
    target.prepack_linears(skinny)
    engine = Engine(target, tok, drafter=PromptLookupDrafter(PLDConfig()), eos_token_ids=[2])
    prompt = tok("the cat sat on the mat. the cat sat on the mat. the cat")["input_ids"]
    out = engine.generate(prompt, max_new_tokens=40)
    assert out.stats.num_drafted_tokens > 0
    assert list(out.token_ids) == greedy_reference(make_tiny_llama(layers=2), prompt, 40, eos_token_id=2)


def test_kernel_switch_off_by_argument_and_environment(monkeypatch):
    from ragspec.engine import Engine

    target = TargetModel(make_tiny_llama(layers=1))
    assert Engine.load_cpu_kernel(target, False) is None
    monkeypatch.setenv("RAGSPEC_CPU_KERNELS", "0")
    assert not cpu_kernels_enabled()
    assert Engine.load_cpu_kernel(target) is None
    monkeypatch.setenv("RAGSPEC_CPU_KERNELS", "")
    assert cpu_kernels_enabled()
    assert cpu_kernels_enabled("1") and not cpu_kernels_enabled("off")
    # other dtypes keep torch's kernels
    half = TargetModel(make_tiny_llama(layers=1).to(torch.bfloat16))
    assert Engine.load_cpu_kernel(half, True) is None


def test_kernel_build_failure_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    if not _cpu_supported():
        pytest.skip("the build is only attempted on Linux x86-64 with AVX2")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.INFO, logger="ragspec.kernels"):
        assert load_skinny_linear(tmp_path / "kernels") is None
    assert "no C++ compiler" in caplog.text
    # a compiler that fails: the error is logged and torch's kernels stay in use
    broken = tmp_path / "broken-c++"
    broken.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    if not shutil.which("ninja"):
        pytest.skip("ninja is needed to attempt a build")
    with caplog.at_level(logging.WARNING, logger="ragspec.kernels"):
        assert load_skinny_linear(tmp_path / "kernels2") is None
    assert "compiled CPU kernel unavailable" in caplog.text
