"""measure_latency_model / measure_latency on a fake target with a fake clock: what is
timed (q, contexts, rounds, first-row-only forwards), the table's key, and the model the
engine gets from it."""

from __future__ import annotations

import time

import pytest
import torch

from ragspec.calibrate import measure_latency, measure_latency_model
from ragspec.policy import LatencyTable


class FakeTarget:
    """verify advances a fake clock by 1 ms * (1 + q / 8) * (1 + cached / 1024)
    (half of that when only the first row of logits is computed)."""

    def __init__(self, clock, max_length=4096):
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.vocab_size = 100
        self.max_length = max_length
        self.config = type("Cfg", (), {"_name_or_path": "fake/model"})()
        self.clock = clock
        self.calls = []
        self.batches = []

    def new_state(self):
        return {"length": 0}

    def state_length(self, state):
        return state["length"]

    def capability(self, name):
        if name == "config":
            return self.config
        return True if name == "lazy_rows" else None

    def prefill(self, state, ids):
        state["length"] += len(ids)

    def verify(self, items):
        # a batch costs its requests' forwards added up
        outs = []
        for it in items:
            q = 1 + it.tree.num_nodes
            self.calls.append((it.state["length"], q, it.lazy_logits))
            self.clock.now += 1e-3 * (1 + q / 8) * (1 + it.state["length"] / 1024) * (0.5 if it.lazy_logits else 1.0)
            row = type("Rows", (), {"argmax": lambda self, r: 0})()
            outs.append(type("Out", (), {"row_logits": row if it.lazy_logits else None})())
        self.batches.append(len(items))
        return outs

    def rollback(self, state, length):
        state["length"] = length


class Clock:
    now = 0.0


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(time, "perf_counter", lambda: c.now)
    return c


def test_cpu_defaults_time_q_1_to_16_at_512_tokens_with_first_row_forwards(clock):
    target = FakeTarget(clock)
    table = measure_latency(target)
    assert table.key == ("cpu", "float32", "fake/model")
    assert table.contexts == (512,)
    assert sorted(table.full[512]) == [1, 2, 3, 4, 5, 6, 8, 10, 12, 16]
    assert table.full[512][8] == pytest.approx(1e-3 * 2 * 1.5)
    assert table.early[512][8] == pytest.approx(0.5e-3 * 2 * 1.5)
    # one warm-up round and three timed rounds of every q, full and first-row-only
    assert len(target.calls) == 4 * 10 * 2


def test_two_contexts_and_the_engine_model_is_their_mean(clock):
    target = FakeTarget(clock)
    lat = measure_latency_model(target, qs=(1, 4, 64), contexts=(512, 1536), repeats=1, early=False)
    # at 512: 1 + q/8 ms * 1.5; at 1536: * 2.5; the mean * 2
    assert lat.table[64] == pytest.approx(1e-3 * 9 * 2.0)
    assert lat.table[1] == pytest.approx(1e-3 * 1.125 * 2.0)
    assert lat.early(4) == lat(4)  # not measured: the full cost
    assert {c for c, _, _ in target.calls} == {512, 1536}


def test_contexts_are_capped_by_the_model_length_and_key_names_the_model(clock):
    target = FakeTarget(clock, max_length=600)
    table = measure_latency(target, qs=(1, 64), contexts=(512, 2048), repeats=1, early=False, model_name="m")
    assert table.contexts == (512, 534)  # 600 - 64 - 2
    assert table.key == ("cpu", "float32", "m")
    with pytest.raises(ValueError):
        measure_latency(FakeTarget(clock, max_length=60), qs=(64,), repeats=1)


def test_latency_table_interpolates_in_context_and_round_trips_through_json():
    t = LatencyTable(
        "cuda:NVIDIA H200", "bfloat16", "smollm2", {512: {1: 0.010, 8: 0.011}, 2048: {1: 0.014, 8: 0.016}}, {}
    )
    assert t.at(1280) == pytest.approx({1: 0.012, 8: 0.0135})
    assert t.at(100) == t.full[512] and t.at(4096) == t.full[2048]
    import json

    back = LatencyTable.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t
    with pytest.raises(ValueError):
        t.at(512, early=True)


def test_a_batch_is_timed_as_one_forward_over_its_requests(clock):
    target = FakeTarget(clock)
    table = measure_latency(target, qs=(1, 4), contexts=(512,), repeats=2, early=False, batch=3)
    # every forward verifies 3 requests, each with its own 512-token cache, rolled back after
    assert set(target.batches) == {3} and len(target.batches) == 3 * 2
    assert {c for c, _, _ in target.calls} == {512}
    assert table.full[512][4] == pytest.approx(3 * 1e-3 * 1.5 * 1.5)
    with pytest.raises(ValueError, match="batch"):
        measure_latency(target, qs=(1,), batch=0)


def test_trees_are_timed_beside_chains_and_the_slower_kept(clock):
    """On CUDA (or ``trees=True``) each q is also verified as a branching tree: the GPU
    draft policy picks wide trees from this table, so it must see what they cost."""

    class TreeCostlier(FakeTarget):
        def verify(self, items):
            for it in items:
                if it.tree.num_nodes and not it.tree.is_chain:
                    self.clock.now += 1e-3  # a tree's rows cost a millisecond more
            return super().verify(items)

    target = TreeCostlier(clock)
    table = measure_latency(target, qs=(1, 8), early=False, trees=True)
    assert len(target.calls) == 4 * 2 * 2  # a warm-up and three timed rounds of 2 q x (chain, tree)
    assert table.full[512][8] == pytest.approx(1e-3 * 2 * 1.5 + 1e-3)  # the tree's time
    assert table.full[512][1] == pytest.approx(1e-3 * (1 + 1 / 8) * 1.5)  # q = 1: no draft either way
    chain_only = measure_latency(FakeTarget(clock), qs=(1, 8), early=False)  # CPU default: chains only
    assert chain_only.full[512][8] == pytest.approx(1e-3 * 2 * 1.5)
