"""The CUDA step as a GPU would run it, checked on the CPU: how many kernels one step
launches per decoder layer (the step on the ``meta`` device, Triton launches recorded, torch
operators logged), and every Triton kernel compiled for Hopper (sm_90) through Triton's
NVIDIA backend with a faked target, without register spills and with the same compiled
specialisation whatever the row count."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from ragspec.bench import cuda_static  # noqa: E402

MAX_KERNELS_PER_LAYER = 9
"""add + norm, q/k/v, rotary + KV write, attention and its combine, o, add + norm,
gate/up + SiLU, down (the step launched 24 at one row, 26 above, before it was fused)."""


@pytest.mark.parametrize("rows", [1, 17])
def test_one_step_launches_at_most_nine_kernels_per_layer_and_no_torch_glue(rows):
    counts = cuda_static.count_step_kernels(rows, layers=4)
    assert counts["per_layer"] <= MAX_KERNELS_PER_LAYER, counts
    assert counts["torch_per_layer"] == [], counts  # no cos/sin gather, rotary ops, index_put_, adds...
    assert counts["fixed"] <= 4, counts  # embedding + first norm, output layer, argmax
    assert counts["per_step"] == 4 * counts["per_layer"] + counts["fixed"]


def test_the_kernel_count_is_the_same_at_one_row_and_at_a_tree():
    assert cuda_static.count_step_kernels(1, layers=3) == cuda_static.count_step_kernels(17, layers=3)


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_without_spills_and_the_same_for_every_row_count():
    pytest.importorskip("triton.backends.nvidia")
    res = cuda_static.compile_for_hopper()
    failed = [k for k in res["kernels"] if k["error"]]
    assert failed == [], failed
    spilled = [k for k in res["kernels"] if k["spill_stores"] or k["spill_loads"]]
    assert spilled == [], spilled
    assert res["row_dependent"] == []  # a 1-, 17- and 256-row step run the same compiled kernels
    names = {k["name"] for k in res["kernels"]}
    assert {"_linear_kernel", "_residual_norm_kernel", "_rope_kv_kernel", "_attn_chunk_kernel"} <= names
    assert res["compiled"] >= 2 * len(names) - 2  # both dtypes


def test_the_static_check_prints_the_documented_json(monkeypatch, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "cuda_static_check.py"
    spec = importlib.util.spec_from_file_location("cuda_static_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(cuda_static, "count_step_kernels", lambda rows: {"per_layer": 9})
    monkeypatch.setattr(
        cuda_static, "compile_for_hopper", lambda: {"compiled": 20, "failed": 0, "spilled": 0, "row_dependent": []}
    )
    monkeypatch.setattr(cuda_static, "host_pack_ms", lambda rows, repeats: 0.05)
    assert script.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {
        "kernels_per_layer": {"1": 9, "17": 9},
        "sm90": {"compiled": 20, "failed": 0, "spilled": 0},
        "host_pack_ms": {"17": 0.05, "65": 0.05},
    }
