"""The CUDA backend's graph runner with a fake capture on CPU: bucketing, padding and
eager fallbacks never change a row's values nor a request's KV slot."""

from __future__ import annotations

import logging

import pytest
import torch

from ragspec.backend.cuda.batch import RequestRows, pack_rows
from ragspec.backend.cuda.graphs import EagerRunner, GraphRunner
from ragspec.backend.cuda.kernels import attention_reference
from ragspec.backend.cuda.kv_pool import KVPool
from ragspec.errors import ConfigError
from ragspec_testing import make_tree

H, HKV, D = 8, 2, 4


class FakeModel:
    """One attention layer over its own KV pool: row outputs depend on the row's token,
    position and keys only (as a real step's must)."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(32, H, generator=g, dtype=torch.float64)
        self.wq = torch.randn(H, 2 * HKV * D, generator=g, dtype=torch.float64)
        self.wk = torch.randn(H, HKV * D, generator=g, dtype=torch.float64)
        self.wv = torch.randn(H, HKV * D, generator=g, dtype=torch.float64)
        self.pool = KVPool(1, 3, 40, HKV, D, dtype=torch.float64)
        self.steps = 0

    @staticmethod
    def linear(x, w):
        return (x[:, :, None] * w[None]).sum(1)  # each row on its own (a GEMM's sums depend on R)

    def step(self, b):
        self.steps += 1
        r = b.tokens.shape[0]
        x = self.emb[b.tokens] + 0.01 * b.positions[:, None].double()
        k = self.linear(x, self.wk).reshape(r, HKV, D)
        v = self.linear(x, self.wv).reshape(r, HKV, D)
        self.pool.keys[0, b.slots.long(), b.write_pos] = k
        self.pool.values[0, b.slots.long(), b.write_pos] = v
        q = self.linear(x, self.wq).reshape(r, 2 * HKV, D)
        meta = (b.slots, b.ctx_len, b.path, b.path_len, b.path_base)
        out = attention_reference(q, self.pool.keys[0], self.pool.values[0], *meta, scale=0.5, dtype=torch.float64)
        return out.reshape(r, -1)


def fake_capture(calls):
    def capture(run):
        calls.append(1)
        run()  # a warm-up, as the CUDA capture does
        return run

    return capture


def _batches():
    tree = make_tree([5, 6, 7, 8], [-1, -1, 0, 2])
    return [
        [RequestRows(0, 0, list(range(1, 6)))],  # a prefill of 5 rows (bucket 8)
        [RequestRows(1, 0, [3, 4, 9])],  # another request's prefill (bucket 4)
        [RequestRows(0, 5, [2, *tree.tokens.tolist()], tree=tree), RequestRows(1, 3, [7])],  # 6 rows
        [RequestRows(0, 10, [11]), RequestRows(1, 4, [12])],  # 2 rows
        [RequestRows(2, 0, list(range(1, 18)))],  # 17 rows: over the largest bucket, eager
        [RequestRows(0, 11, [13])],  # 1 row
    ]


def test_buckets_and_padding_never_change_a_row_or_a_slot():
    eager, graphed = FakeModel(), FakeModel()
    calls: list[int] = []
    runner = GraphRunner(
        graphed.step,
        scratch_slot=graphed.pool.scratch_slot,
        device="cpu",
        buckets=(1, 2, 4, 8, 16),
        path_width=6,
        capture=fake_capture(calls),
    )
    plain = EagerRunner(eager.step)
    for reqs in _batches():
        batch = pack_rows(reqs)
        a, b = plain(batch), runner(batch)
        assert a.shape == b.shape == (batch.rows, 2 * HKV * D)
        assert torch.equal(a, b)
        n = eager.pool.num_slots
        assert torch.equal(eager.pool.keys[:, :n], graphed.pool.keys[:, :n])
        assert torch.equal(eager.pool.values[:, :n], graphed.pool.values[:, :n])
    assert sorted(runner.captured) == [1, 2, 4, 8] and len(calls) == 4
    assert runner.eager_steps == 1 and runner.graph_steps == 5


def test_a_path_wider_than_the_buffers_and_a_failed_capture_run_eagerly(caplog):
    eager, graphed = FakeModel(), FakeModel()
    tree = make_tree([5, 6, 7], [-1, 0, 1])  # a chain: causal rows
    deep = make_tree([5, 6, 7, 8], [-1, 0, 1, 0])  # depth 3: a path of 4 rows
    reqs = [RequestRows(0, 0, [1, 2, 3]), RequestRows(0, 3, [4, *deep.tokens.tolist()], tree=deep)]

    def broken(run):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner = GraphRunner(graphed.step, scratch_slot=3, device="cpu", buckets=(4, 8), path_width=3, capture=broken)
    assert tree.is_chain
    for r in reqs:
        batch = pack_rows([r])
        with caplog.at_level(logging.WARNING):
            assert torch.equal(EagerRunner(eager.step)(batch), runner(batch))
    assert runner.eager_steps == 2 and runner.captured == []
    assert "capture" in caplog.text


def test_buckets_must_increase():
    with pytest.raises(ConfigError):
        GraphRunner(lambda b: b.tokens, scratch_slot=0, device="cpu", buckets=(4, 2))


def test_bucket_buffers_made_under_inference_mode_work_outside_it():
    """Regression ("Inplace update to inference tensor outside InferenceMode"): a bucket
    first used under ``torch.inference_mode()`` (calibration) made its buffers inference
    tensors, and the next step outside inference mode failed copying into them."""
    model = FakeModel()
    runner = GraphRunner(model.step, scratch_slot=3, device="cpu", buckets=(4,), path_width=4, capture=fake_capture([]))
    batch = pack_rows([RequestRows(0, 0, [1, 2, 3])])
    with torch.inference_mode():
        first = runner(batch).clone()
    again = runner(pack_rows([RequestRows(1, 0, [1, 2, 3])]))  # outside: must not raise
    assert torch.equal(first, again) and runner.graph_steps == 2


def test_capture_all_captures_every_bucket_on_padding_rows_only():
    model = FakeModel()
    calls: list[int] = []
    runner = GraphRunner(model.step, scratch_slot=3, device="cpu", buckets=(1, 2, 4), capture=fake_capture(calls))
    assert runner.capture_all() == [] and sorted(runner.captured) == [1, 2, 4] and len(calls) == 3
    n = model.pool.num_slots
    assert not model.pool.keys[:, :n].any() and not model.pool.values[:, :n].any()  # real slots untouched
    assert runner.graph_steps == runner.eager_steps == 0  # capturing is not a step
    runner.capture_all()
    assert len(calls) == 3  # nothing captured twice


def test_run_packs_into_the_bucket_and_cuts_the_padding():
    eager, graphed = FakeModel(), FakeModel()
    runner = GraphRunner(
        graphed.step, scratch_slot=3, device="cpu", buckets=(4, 8), path_width=6, capture=fake_capture([])
    )
    tree = make_tree([5, 6, 7, 8], [-1, -1, 0, 2])
    reqs = [RequestRows(0, 0, [2, *tree.tokens.tolist()], tree=tree), RequestRows(1, 0, [7, 9])]
    out, cu = runner.run(reqs)
    assert cu == (0, 5, 7) and out.shape[0] == 7
    assert torch.equal(out, EagerRunner(eager.step)(pack_rows(reqs)))


def test_default_buckets_reach_the_prefill_chunk():
    # every prefill chunk of the engine's default size replays a graph instead of running eagerly
    from ragspec.backend.cuda.graphs import DEFAULT_BUCKETS
    from ragspec.config import PolicyConfig

    assert DEFAULT_BUCKETS[-1] >= PolicyConfig().prefill_chunk_tokens
