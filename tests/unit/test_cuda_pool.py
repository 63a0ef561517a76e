"""The CUDA backend's KV pool (allocate / commit / rollback / free) and flat-batch packing,
on CPU tensors (no triton needed)."""

from __future__ import annotations

import gc

import pytest
import torch

from ragspec.backend.cuda.batch import RequestRows, buffer_size, pack_rows, pad_batch, tree_paths
from ragspec.backend.cuda.kernels import attention_reference
from ragspec.backend.cuda.kv_pool import KVPool, SlotOverflowError
from ragspec.errors import CapacityError, ConfigError
from ragspec.tree import tree_attention_mask, tree_position_ids
from ragspec.types import DraftTree
from ragspec_testing import make_tree


def _pool(slots=3, cap=16):
    return KVPool(2, slots, cap, 2, 4)


def _fill(pool, slot, start, stop):
    """Entries whose values name their position (keys +, values -)."""
    for p in range(start, stop):
        pool.keys[:, slot, p] = float(p)
        pool.values[:, slot, p] = -float(p)


def test_allocate_until_full_then_free_by_release_and_by_garbage_collection():
    pool = _pool(slots=2)
    a, b = pool.allocate(), pool.allocate()
    assert {a.slot, b.slot} == {0, 1} and pool.free_slots == 0
    with pytest.raises(CapacityError):
        pool.allocate()
    pool.release(a)
    pool.release(a)  # twice is harmless
    c = pool.allocate()
    assert c.slot == a.slot and c.length == 0
    del b
    gc.collect()
    assert pool.free_slots == 1
    assert pool.allocate().slot != c.slot


def test_advance_past_the_slot_raises_a_typed_error():
    pool = _pool(cap=8)
    s = pool.allocate()
    pool.advance(s.slot, 6)
    with pytest.raises(SlotOverflowError) as e:
        pool.advance(s.slot, 3)
    assert isinstance(e.value, CapacityError) and "8" in str(e.value)
    assert s.length == 6  # unchanged by the refusal


def test_commit_compacts_the_accepted_path_into_place():
    pool = _pool()
    s, other = pool.allocate(), pool.allocate()
    _fill(pool, other.slot, 0, 10)
    before = pool.keys[:, other.slot].clone()
    past = 5
    _fill(pool, s.slot, 0, past + 6)  # root at 5, nodes 0..4 at 6..10
    pool.advance(s.slot, past + 6)
    pool.commit(s.slot, past, [1, 3])  # node 1 (at 7), node 3 (at 9)
    assert s.length == past + 3
    assert pool.keys[0, s.slot, : past + 3, 0, 0].tolist() == [0, 1, 2, 3, 4, 5, 7, 9]
    assert pool.values[1, s.slot, past + 1 : past + 3, 1, 2].tolist() == [-7, -9]
    assert torch.equal(pool.keys[:, other.slot], before)


def test_commit_of_a_prefix_copies_nothing_and_rollback_does_not_advance():
    pool = _pool()
    s = pool.allocate()
    _fill(pool, s.slot, 0, 9)
    pool.advance(s.slot, 9)
    pool.commit(s.slot, 4, [0, 1])
    assert s.length == 7 and pool.keys[0, s.slot, :7, 0, 0].tolist() == list(range(7))
    pool.rollback(s.slot, 3)
    assert s.length == 3
    pool.rollback(s.slot, 5)  # never grows
    assert s.length == 3
    with pytest.raises(ConfigError):
        pool.commit(s.slot, 2, [4])  # node 4 was not verified


def test_export_import_round_trip_is_exact():
    pool = _pool()
    a, b = pool.allocate(), pool.allocate()
    pool.keys[:, a.slot].normal_()
    pool.values[:, a.slot].normal_()
    pool.advance(a.slot, 10)
    blocks = [pool.export(a.slot, 0, 4), pool.export(a.slot, 4, 10)]
    assert blocks[0].shape == (2, 2, 2, 4, 4)
    pool.import_(b.slot, blocks)
    assert b.length == 10
    assert torch.equal(pool.keys[:, b.slot, :10], pool.keys[:, a.slot, :10])
    assert torch.equal(pool.values[:, b.slot, :10], pool.values[:, a.slot, :10])
    with pytest.raises(ConfigError):
        pool.export(a.slot, 5, 11)
    with pytest.raises(SlotOverflowError):
        pool.import_(b.slot, blocks)


def test_pack_rows_offsets_positions_and_paths_match_the_tree_mask():
    tree = make_tree([5, 6, 7, 8], [-1, -1, 0, 2])  # branching
    chain = DraftTree.chain([9, 10])
    batch = pack_rows(
        [
            RequestRows(slot=0, past=7, tokens=[3]),  # plain decoding
            RequestRows(slot=2, past=4, tokens=[1, *tree.tokens.tolist()], tree=tree),
            RequestRows(slot=1, past=3, tokens=[2, 9, 10], tree=chain),
        ]
    )
    assert batch.cu_rows == (0, 1, 6, 9)
    assert batch.slots.tolist() == [0] + [2] * 5 + [1] * 3
    assert batch.write_pos.tolist() == [7, 4, 5, 6, 7, 8, 3, 4, 5]
    assert batch.positions[1:6].tolist() == tree_position_ids(tree, 4)[0].tolist()
    # causal rows: their own prefix; tree rows: the context, then their ancestors
    assert batch.ctx_len.tolist() == [8, 4, 4, 4, 4, 4, 4, 5, 6]
    mask = tree_attention_mask(tree, 4)[0, 0, :, 4:]  # [N+1, N+1] among the tree rows
    for j, path in enumerate(tree_paths(tree)):
        assert path == [i for i in range(5) if mask[j, i]]
        n = int(batch.path_len[1 + j])
        assert batch.path[1 + j, :n].tolist() == path
    assert batch.path_len[[0, 6, 7, 8]].tolist() == [0, 0, 0, 0]
    with pytest.raises(ConfigError):
        pack_rows([RequestRows(0, 0, [1, 2], tree=tree)])
    with pytest.raises(ConfigError):
        pack_rows([RequestRows(2, 4, [1, *tree.tokens.tolist()], tree=tree)], path_width=2)


def test_packed_attention_equals_the_tree_mask_over_each_request_alone():
    """The packed rows of two requests in one attention == each request's own masked
    attention (the transformers backend's tree mask) over its slot."""
    torch.manual_seed(0)
    pool = KVPool(1, 2, 24, 2, 4)
    pool.keys.normal_()
    pool.values.normal_()
    tree = make_tree([5, 6, 7, 8], [-1, -1, 0, 2])
    reqs = [RequestRows(1, 9, [1, *tree.tokens.tolist()], tree=tree), RequestRows(0, 6, [4, 5, 6])]
    batch = pack_rows(reqs)
    q = torch.randn(batch.rows, 4, 4, dtype=torch.float64)
    meta = (batch.slots, batch.ctx_len, batch.path, batch.path_len, batch.path_base)
    out = attention_reference(q, pool.keys[0], pool.values[0], *meta, scale=0.5, dtype=torch.float64)
    for (a, b), req in zip(zip(batch.cu_rows[:-1], batch.cu_rows[1:]), reqs):
        n = b - a
        if req.tree is not None:
            mask = tree_attention_mask(req.tree, req.past)[0, 0]  # [N+1, past+N+1]
        else:
            mask = torch.ones(n, req.past + n, dtype=torch.bool).tril(req.past)
        k = pool.keys[0, req.slot, : req.past + n].double().repeat_interleave(2, dim=1)  # [T, Hq, d]
        v = pool.values[0, req.slot, : req.past + n].double().repeat_interleave(2, dim=1)
        s = torch.einsum("rhd,thd->rht", q[a:b], k) * 0.5
        p = torch.softmax(s.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
        assert torch.allclose(out[a:b], torch.einsum("rht,thd->rhd", p, v), atol=1e-12)


def test_pad_batch_rows_touch_only_the_scratch_slot():
    batch = pack_rows([RequestRows(0, 2, [3, 4])])
    padded = pad_batch(batch, 8, scratch_slot=5)
    assert padded.rows == 8 and padded.cu_rows == batch.cu_rows
    assert padded.slots[2:].tolist() == [5] * 6 and padded.ctx_len[2:].tolist() == [1] * 6
    assert torch.equal(padded.tokens[:2], batch.tokens)
    assert pad_batch(batch, 2, 5) is batch
    with pytest.raises(ConfigError):
        pad_batch(batch, 1, 5)


def test_the_cuda_backend_imports_without_the_server_and_datastore_packages():
    """The GPU machine's image lacks fastapi, pydantic, faiss, langchain and pyahocorasick:
    the backend (and the engine it serves) must import without them."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('fastapi', 'pydantic', 'faiss', 'langchain', 'langchain_core', 'ahocorasick'):\n"
        "    sys.modules[m] = None\n"
        "import ragspec.backend.cuda, ragspec.backend.cuda.target, ragspec.engine\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_gpu_draft_policy_follows_the_measured_table():
    from ragspec.backend.cuda.drafting import gpu_draft_policy, nearly_free_rows
    from ragspec.config import PolicyConfig

    # an H200-like step: flat to 32 rows, then growing
    gpu = {1: 4.0e-3, 2: 4.0e-3, 4: 4.05e-3, 8: 4.1e-3, 16: 4.2e-3, 32: 4.5e-3, 48: 5.2e-3, 64: 6.0e-3}
    assert nearly_free_rows(gpu) == 32
    policy = gpu_draft_policy(gpu, PolicyConfig(prefill_chunk_tokens=512))
    assert policy.max_draft_tokens == 31 and policy.max_step_rows == 64 and policy.prefill_chunk_tokens == 512
    # a CPU-like table: every row costs; the budget stays at the GPU floor, 16
    cpu = {1: 0.05, 2: 0.06, 4: 0.08, 8: 0.12, 16: 0.2}
    assert gpu_draft_policy(cpu).max_draft_tokens == 16
    assert gpu_draft_policy({1: 1e-3, 128: 1e-3}).max_draft_tokens == 64
    with pytest.raises(ConfigError):
        gpu_draft_policy({2: 1e-3})
    with pytest.raises(ConfigError):
        gpu_draft_policy(gpu, min_budget=70)


def _random_tree(seed: int, nodes: int) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(-1, j, (1,), generator=gen)) for j in range(1, nodes)]
    return make_tree(list(range(10, 10 + nodes)), parents)


def test_vectorised_paths_match_the_tree_attention_mask_for_random_trees():
    for seed in range(6):
        tree = _random_tree(seed, 12)
        batch = pack_rows([RequestRows(0, 3, [1, *tree.tokens.tolist()], tree=tree)])
        mask = tree_attention_mask(tree, 3)[0, 0, :, 3:]
        for j in range(tree.num_nodes + 1):
            n = int(batch.path_len[j])
            assert batch.path[j, :n].tolist() == [i for i in range(tree.num_nodes + 1) if mask[j, i]]
            assert not batch.path[j, n:].any()
        assert batch.positions.tolist() == tree_position_ids(tree, 3)[0].tolist()


def test_packing_into_a_bucket_staging_buffer_equals_padding_the_loose_batch():
    """The one-copy path (packed straight into a bucket's staging buffer, padded, fields
    16-byte aligned) holds the same rows as the loose batch padded afterwards."""
    tree = _random_tree(7, 9)
    reqs = [RequestRows(2, 30, [1, *tree.tokens.tolist()], tree=tree), RequestRows(0, 4, [5, 6, 7])]
    loose = pack_rows(reqs)
    staging = torch.full((buffer_size(16, 12),), -7, dtype=torch.int32)
    packed = pack_rows(reqs, path_width=12, rows=16, scratch_slot=5, out=staging)
    assert packed.buffer is not None and packed.buffer.data_ptr() == staging.data_ptr()
    assert packed.rows == 16 and packed.real_rows == 13 and packed.cu_rows == loose.cu_rows
    padded = pad_batch(loose, 16, scratch_slot=5)
    for name in ("tokens", "positions", "slots", "write_pos", "ctx_len", "path_len", "path_base"):
        assert torch.equal(getattr(packed, name), getattr(padded, name)), name
        assert getattr(packed, name).data_ptr() % 16 == 0
    assert torch.equal(packed.path[:, : loose.path_width], padded.path) and not packed.path[:, loose.path_width :].any()
    with pytest.raises(ConfigError):
        pack_rows(reqs, rows=8, out=staging)  # 13 rows do not fit a bucket of 8


def test_auto_drafting_on_cuda_reads_the_choice_the_gpu_check_recorded(tmp_path, monkeypatch):
    """--drafting auto on CUDA is what the GPU check measured faster on that GPU model (the
    head merged with retrieval, or retrieval alone), "merged" where nothing is recorded; a
    CPU keeps retrieval."""
    from ragspec import loading
    from ragspec.backend.cuda.drafting import record_drafting, recorded_drafting

    monkeypatch.setenv("RAGSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert loading.resolve_drafting("auto", torch.device("cuda")) == "merged"
    measured = {"auto": {"tok_s": 300.0}, "retrieval": {"tok_s": 340.0}}
    record_drafting("NVIDIA H100 80GB HBM3", "retrieval", measured, tmp_path)
    assert recorded_drafting("NVIDIA H100 80GB HBM3", tmp_path) == "retrieval"
    assert recorded_drafting("NVIDIA H200", tmp_path) is None
    assert loading.resolve_drafting("auto", torch.device("cuda")) == "retrieval"
    assert loading.resolve_drafting("merged", torch.device("cuda")) == "merged"
    assert loading.resolve_drafting("auto", torch.device("cpu")) == "retrieval"
    with pytest.raises(ConfigError):
        record_drafting("x", "fastest", measured, tmp_path)
    (tmp_path / "calibration" / "cuda-drafting.json").write_text("{not json")
    assert recorded_drafting("NVIDIA H100 80GB HBM3", tmp_path) is None  # a damaged record: ignored
