"""``ragspec bench --compare``: the comparison runner's place in ``run_bench`` (prepared once,
interleaved, its figures and identity in the records, the summary and the table), the
llama.cpp runner's greedy loop over a stand-in ``llama_cpp`` module, and the typed error
when llama-cpp-python is missing. Nothing here needs llama.cpp; the real runner is tested in
tests/e2e/test_llamacpp_compare.py when llama_cpp is importable."""

from __future__ import annotations

import ctypes
import json
import sys
import types

import pytest

from ragspec import Engine, PolicyConfig
from ragspec.backend.hf import HFTarget
from ragspec.bench.compare import PlainRun, PlainRunner, open_runner, require, summarize_compare
from ragspec.bench.compare.llamacpp import LlamaCppRunner, context_size
from ragspec.bench.records import BenchRecord
from ragspec.bench.runner import format_table, run_bench, summarize
from ragspec.cli import main
from ragspec.drafters import PromptLookupDrafter
from ragspec.errors import ConfigError, MissingDependencyError
from ragspec.policy import LatencyModel
from ragspec_testing import greedy_reference, make_tiny_llama

PROMPT = "the cat sat on the mat. the cat sat on the hat."


def _engine(char_tokenizer):
    model = make_tiny_llama(vocab_size=len(char_tokenizer.get_vocab()) + 3, eos_token_id=None)
    engine = Engine(
        HFTarget(model),
        char_tokenizer,
        drafter=PromptLookupDrafter(),
        policy=PolicyConfig(max_draft_tokens=8),
        latency=LatencyModel({1: 0.010, 8: 0.011, 32: 0.013}),
        eos_token_ids=(),
    )
    return engine, model


class GreedyRunner:
    """A comparison runner doing transformers greedy itself, optionally changing one token
    (``flip_at``) to stand for a decoder whose numerics diverge there."""

    name = "fake"

    def __init__(self, model, flip_at=None):
        self.model = model
        self.flip_at = flip_at
        self.prepared = []
        self.calls = []
        self.closed = False

    def prepare(self, max_tokens):
        self.prepared.append(max_tokens)

    def generate(self, ids, max_new_tokens, eos):
        self.calls.append((len(ids), max_new_tokens))
        toks = greedy_reference(self.model, list(ids), max_new_tokens, eos_token_id=None)
        if self.flip_at is not None and self.flip_at < len(toks):
            toks = toks[: self.flip_at] + [(toks[self.flip_at] + 1) % 20]
            toks += [toks[-1]] * (max_new_tokens - len(toks))
        return PlainRun(toks, prefill_s=0.002, decode_s=0.001 * (len(toks) - 1))

    def info(self):
        return {"fake": True}

    def close(self):
        self.closed = True


def test_fake_runner_satisfies_the_protocol(char_tokenizer):
    _, model = _engine(char_tokenizer)
    assert isinstance(GreedyRunner(model), PlainRunner)


@pytest.mark.parametrize("flip_at", [None, 5])
def test_bench_runs_the_compare_runner_interleaved_and_reports_it(char_tokenizer, single_thread, flip_at):
    engine, model = _engine(char_tokenizer)
    rows = [{"question_id": i, "category": c, "turns": [PROMPT * (1 + i)]} for i, c in enumerate(["rag", "qa", "rag"])]
    runner = GreedyRunner(model, flip_at=flip_at)
    records = run_bench(engine, rows, max_new_tokens=12, hf_pld=False, warmup=True, compare=[runner])
    lengths = [len(engine.encode_prompt(r["turns"][0], chat=True)) for r in rows]
    assert runner.prepared == [max(lengths) + 12]  # loaded once, sized for the longest request
    # the warm-up (16 tokens capped at 12) and then every prompt, with the bench's own ids
    assert runner.calls == [(lengths[0], 12)] + [(n, 12) for n in lengths]
    for r in records:
        c = r.compare["fake"]
        assert c["tokens"] == 12 and c["s"] > 0 and c["prefill_s"] == 0.002
        assert c["identical"] is (flip_at is None) and c["first_diff"] == (-1 if flip_at is None else flip_at)
        assert r.identical  # ragspec itself still equals the baseline
        # ragspec's steps were recorded for the plain-step time (no --json needed)
        assert r.plain_steps > 0 and r.plain_step_s > 0 and r.steps == []
    table = summarize(records)
    fake = table["all"]["compare"]["fake"]
    assert fake["prompts"] == 3 and fake["identical"] == (3 if flip_at is None else 0)
    assert fake["first_diffs"] == ([] if flip_at is None else [flip_at] * 3)
    assert fake["decode_ms_per_token"] == pytest.approx(1.0)
    assert fake["ratio"] == pytest.approx(table["all"]["ragspec_tok_s"] / fake["tok_s"])
    assert table["rag"]["compare"]["fake"]["prompts"] == 2
    text = format_table(table)
    block = text.split("# fake: plain greedy")[1].splitlines()
    assert "fake tok/s" in block[1] and "ragspec plain ms/tok" in block[1] and "fake vs greedy" in block[1]
    assert [line.split()[0] for line in block[3:]] == ["rag", "qa", "all"]
    assert block[-1].split()[-1] == "3/3" if flip_at is None else block[-1].split()[-2:] == ["0/3", f"@{flip_at}"]


def test_bench_without_compare_has_no_compare_block(char_tokenizer, single_thread):
    engine, _ = _engine(char_tokenizer)
    records = run_bench(engine, [{"question_id": 0, "category": "rag", "turns": [PROMPT]}], max_new_tokens=6)
    table = summarize(records)
    assert "compare" not in table["all"] and "plain greedy" not in format_table(table)


def test_compare_refuses_sampling(char_tokenizer):
    engine, model = _engine(char_tokenizer)
    with pytest.raises(ConfigError, match="greedy"):
        run_bench(engine, [{"category": "rag", "turns": [PROMPT]}], temperature=0.7, compare=[GreedyRunner(model)])


def _record(tokens, s, prefill, plain_s, plain_n, entry):
    r = BenchRecord(1, "rag", 10, tokens, 1.0, s, tokens, True, -1, 1.0, 0.0, 0, 0, tokens)
    r.prefill_s, r.plain_step_s, r.plain_steps = prefill, plain_s, plain_n
    r.compare = {"llamacpp": entry}
    return r


def test_summarize_compare_figures_from_the_records():
    e1 = {"s": 2.0, "tokens": 101, "prefill_s": 0.5, "decode_s": 1.5, "identical": False, "first_diff": 40}
    e2 = {"s": 1.0, "tokens": 51, "prefill_s": 0.3, "decode_s": 0.5, "identical": True, "first_diff": -1}
    r1 = _record(101, 4.0, 1.0, 0.6, 20, e1)
    r2 = _record(51, 1.0, 0.25, 0.0, 0, e2)
    c = summarize_compare([r1, r2])["llamacpp"]
    assert c["tok_s"] == pytest.approx(152 / 3.0)
    assert c["prefill_s"] == pytest.approx(0.4)
    assert c["decode_tok_s"] == pytest.approx(150 / 2.0)
    assert c["decode_ms_per_token"] == pytest.approx(1e3 * 2.0 / 150)
    assert c["identical"] == 1 and c["first_diffs"] == [40]
    assert c["ragspec_tok_s"] == pytest.approx(152 / 5.0)
    assert c["ragspec_prefill_s"] == pytest.approx(0.625)
    assert c["ragspec_decode_tok_s"] == pytest.approx(150 / (3.0 + 0.75))
    assert c["ragspec_plain_step_ms"] == pytest.approx(1e3 * 0.6 / 20)
    assert c["ratio"] == pytest.approx((152 / 5.0) / (152 / 3.0))
    assert c["decode_ratio"] == pytest.approx((150 / 3.75) / 75.0)
    # no step figures: the plain-step column is empty, not zero
    assert summarize_compare([r2])["llamacpp"]["ragspec_plain_step_ms"] is None
    assert "-" in format_table(summarize([r2])).split("# llamacpp")[1].splitlines()[-1].split()


# ---------------------------------------------------------------- llama.cpp runner, stand-in module
class _FakeLlama:
    """Enough of ``llama_cpp.Llama`` for the runner: ``eval`` appends to a KV of token ids
    from position ``n_tokens`` (as the real one drops later positions), the next token's
    logits are a function of the whole sequence so a stale KV would change them."""

    instances: list = []

    def __init__(self, **kw):
        self.kw = kw
        self.vocab = 32
        self.kv: list[int] = []
        self.n_tokens = 0
        self.evals: list[int] = []
        self.resets = 0
        self.closed = False
        self.buf = (ctypes.c_float * self.vocab)()
        self.ctx = object()
        self.model = object()
        _FakeLlama.instances.append(self)

    def n_vocab(self):
        return self.vocab

    def reset(self):
        self.resets += 1
        self.n_tokens = 0

    def eval(self, tokens):
        del self.kv[self.n_tokens :]
        self.kv.extend(tokens)
        self.n_tokens = len(self.kv)
        self.evals.append(len(tokens))
        nxt = (sum(self.kv) * 7 + len(self.kv)) % self.vocab
        for i in range(self.vocab):
            self.buf[i] = -abs(i - nxt)

    def close(self):
        self.closed = True


def _fake_module():
    mod = types.SimpleNamespace(__version__="0.0-test")
    mod.Llama = _FakeLlama
    mod.llama_get_logits_ith = lambda ctx, i: ctypes.cast(_FakeLlama.instances[-1].buf, ctypes.POINTER(ctypes.c_float))
    mod.llama_print_system_info = lambda: b"AVX = 1 | FAKE = 1 |"
    return mod


def _expected(ids, n, eos=()):
    seq, out = list(ids), []
    while len(out) < n:
        t = (sum(seq) * 7 + len(seq)) % 32
        out.append(t)
        seq.append(t)
        if t in eos:
            break
    return out


def test_llamacpp_runner_greedy_loop_resets_the_kv_and_keeps_eos(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    _FakeLlama.instances.clear()
    runner = LlamaCppRunner(gguf, threads=3, module=_fake_module())
    runner.prepare(700)
    llama = _FakeLlama.instances[-1]
    assert llama.kw["n_ctx"] == context_size(700) == 768
    assert llama.kw["n_threads"] == llama.kw["n_threads_batch"] == 3 and llama.kw["logits_all"] is False
    a, b = [5, 9, 1, 4], [3, 3]
    first = runner.generate(a, 10)
    assert first.tokens == _expected(a, 10) and first.prefill_s > 0 and first.decode_s > 0
    assert llama.evals == [4] + [1] * 9  # the prompt in one eval, then one token per step
    runner.generate(b, 10)
    assert runner.generate(a, 10).tokens == first.tokens  # no state carried between prompts
    assert llama.resets == 3 and len(_FakeLlama.instances) == 1  # loaded once
    eos = first.tokens[3]
    stopped = runner.generate(a, 10, eos=[eos])
    assert stopped.tokens == _expected(a, 10, eos=[eos]) and stopped.tokens[-1] == eos
    info = runner.info()
    assert info["llama_cpp_python"] == "0.0-test" and info["n_ctx"] == 768 and "FAKE" in info["system_info"]
    runner.prepare(300)  # fits: no reload
    assert len(_FakeLlama.instances) == 1
    runner.generate(list(range(1, 901)), 10)  # more room needed: loaded again, larger
    assert len(_FakeLlama.instances) == 2 and llama.closed and _FakeLlama.instances[-1].kw["n_ctx"] == 1024
    with pytest.raises(ConfigError):
        runner.generate([], 4)
    with pytest.raises(ConfigError):
        runner.generate(a, 0)
    runner.close()
    assert _FakeLlama.instances[-1].closed


class _FakeBatchedContext:
    """Enough of llama.cpp's multi-sequence context for ``generate_batched``: per sequence id
    a KV of token ids that ``llama_decode`` extends (positions must follow on), rows with
    logits set get ``_expected``'s next token of their sequence so far."""

    def __init__(self, params, vocab=32):
        self.params = params
        self.vocab = vocab
        self.kv: dict[int, list[int]] = {}
        self.calls: list[tuple[int, int]] = []  # (tokens, sequences) per llama_decode
        self.bufs: list = []
        self.freed = False

    def decode(self, batch):
        seqs = set()
        self.bufs = []
        for i in range(batch.n_tokens):
            seq = batch.seq_id[i][0]
            kv = self.kv.setdefault(seq, [])
            assert batch.pos[i] == len(kv), "positions must follow the sequence's cache"
            kv.append(batch.token[i])
            seqs.add(seq)
            buf = (ctypes.c_float * self.vocab)()
            if batch.logits[i]:
                nxt = (sum(kv) * 7 + len(kv)) % self.vocab
                for v in range(self.vocab):
                    buf[v] = -abs(v - nxt)
            self.bufs.append(buf)
        self.calls.append((batch.n_tokens, len(seqs)))
        return 0


def _fake_batched_module():
    mod = _fake_module()
    made: list = []
    mod.made = made
    mod.llama_context_default_params = lambda: types.SimpleNamespace()

    def init(model, params):
        made.append(_FakeBatchedContext(params))
        return made[-1]

    def batch_init(n, embd, n_seq):
        return types.SimpleNamespace(
            n_tokens=0, token=[0] * n, pos=[0] * n, n_seq_id=[0] * n, seq_id=[[0] for _ in range(n)], logits=[0] * n
        )

    mod.llama_init_from_model = init
    mod.llama_batch_init = batch_init
    mod.llama_batch_free = lambda b: None
    mod.llama_decode = lambda ctx, b: ctx.decode(b)
    mod.llama_get_logits_ith = lambda ctx, i: ctypes.cast(ctx.bufs[i], ctypes.POINTER(ctypes.c_float))
    mod.llama_get_memory = lambda ctx: ctx
    mod.llama_memory_seq_rm = lambda mem, seq, p0, p1: mem.kv.pop(seq, None)

    def free(ctx):
        ctx.freed = True

    mod.llama_free = free
    return mod


def test_llamacpp_batched_serves_each_request_its_solo_greedy_in_slots(tmp_path):
    """llama-server -np 2 on 3 requests: each gets its own sequence's greedy tokens (EOS
    kept), the third takes the slot the first frees, its cache starts empty; prompts go in
    batches of at most n_batch tokens with the generating slots' tokens first."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    mod = _fake_batched_module()
    _FakeLlama.instances.clear()
    runner = LlamaCppRunner(gguf, threads=2, n_batch=8, module=mod)
    prompts = [[5, 9, 1, 4], [3] * 11, [2, 7]]
    eos = _expected(prompts[2], 6)[2]
    run = runner.generate_batched(prompts, 6, slots=2, eos=[eos])
    assert run.tokens == [_expected(p, 6, eos=[eos]) for p in prompts]
    ctx = mod.made[-1]
    assert ctx.params.n_seq_max == 2 and ctx.params.kv_unified is True and ctx.params.n_threads == 2
    assert ctx.freed and all(n <= 8 + 2 for n, _ in ctx.calls) and max(s for _, s in ctx.calls) == 2
    assert ctx.calls[0] == (8, 2)  # 4 + 4 prompt tokens: the second prompt split over calls
    assert all(t >= 0 for t in run.ttft_s) and all(a >= b for a, b in zip(run.latency_s, run.ttft_s))
    assert run.steps == len(ctx.calls) and 1.0 <= run.mean_batch <= 2.0 and run.prefill_s > 0
    with pytest.raises(ConfigError):
        runner.generate_batched([], 4, slots=2)
    with pytest.raises(ConfigError):
        runner.generate_batched([[1]], 4, slots=0)


def test_concurrency_level_through_llamacpp_counts_like_ragspec(tmp_path):
    from ragspec.bench.concurrency import run_level_llamacpp

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    runner = LlamaCppRunner(gguf, threads=2, n_batch=16, module=_fake_batched_module())
    prompts = [[5, 9, 1, 4], [3] * 11]
    solo = [_expected(p, 5) for p in prompts]
    res = run_level_llamacpp(runner, prompts, 4, max_new_tokens=5, reference=solo)
    assert res.requests == 4 and res.identical == 4 and res.generated_tokens == 20
    assert res.tokens == [solo[0], solo[1], solo[0], solo[1]]
    assert res.aggregate_tok_s > 0 and res.decode_tok_s > 0 and res.latency_p95_s >= res.latency_p50_s


def test_open_runner_needs_a_gguf_file_and_threads(tmp_path):
    mod = _fake_module()
    with pytest.raises(ConfigError, match="GGUF file not found"):
        LlamaCppRunner(tmp_path / "missing.gguf", threads=2, module=mod)
    with pytest.raises(ConfigError, match="unknown --compare"):
        open_runner("vllm", gguf=tmp_path / "x.gguf", threads=2)


# ---------------------------------------------------------------- llama_cpp missing
@pytest.fixture
def no_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError


def test_missing_llama_cpp_is_a_typed_error_naming_the_extra(no_llama_cpp, tmp_path):
    with pytest.raises(MissingDependencyError, match=r"ragspec\[compare\]"):
        require("llamacpp")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(MissingDependencyError):
        LlamaCppRunner(gguf, threads=2)
    with pytest.raises(MissingDependencyError):
        open_runner("llamacpp", gguf=gguf, threads=2)


def test_bench_compare_without_llama_cpp_exits_2_with_one_line(no_llama_cpp, tmp_path, capsys, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "rag", "turns": ["hi"]}) + "\n")
    # the check runs before any model is resolved or loaded: a missing model would say so instead
    monkeypatch.setenv("RAGSPEC_CACHE", str(tmp_path / "empty-cache"))
    rc = main(["bench", "--data", str(data), "--compare", "llamacpp", "--model", str(tmp_path / "none.gguf")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "ragspec: error:" in err and "ragspec[compare]" in err and "Traceback" not in err


def test_bench_compare_refuses_temperature_before_loading(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "rag", "turns": ["hi"]}) + "\n")
    rc = main(["bench", "--data", str(data), "--compare", "llamacpp", "--temperature", "0.5"])
    assert rc == 2 and "greedy" in capsys.readouterr().err


def test_probe_reports_a_crashing_llama_cpp_build_as_a_typed_error(monkeypatch, tmp_path):
    # a build whose batch eval dies of a signal (ggml's AMX kernels in a VM that faults on
    # AMX, found on this project's machine) must not take the bench's process with it
    import subprocess

    from ragspec.bench.compare import llamacpp
    from ragspec.errors import ModelLoadError

    def run(returncode, stderr=""):
        monkeypatch.setattr(
            llamacpp.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, returncode, "", stderr)
        )

    run(-11)
    with pytest.raises(ModelLoadError, match="signal 11.*-mno-amx-int8"):
        llamacpp.probe_batch_eval(tmp_path / "m.gguf", 2)
    run(1, "Traceback ...\nValueError: Failed to load model from file")
    with pytest.raises(ModelLoadError, match="Failed to load model"):
        llamacpp.probe_batch_eval(tmp_path / "m.gguf", 2)
    run(0)
    llamacpp.probe_batch_eval(tmp_path / "m.gguf", 2)
    # the runner probes once, before its first load, with the real module only
    calls = []
    monkeypatch.setattr(llamacpp, "probe_batch_eval", lambda path, threads: calls.append((path, threads)))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    LlamaCppRunner(gguf, threads=2, module=_fake_module()).prepare(10)
    assert calls == []
    r = LlamaCppRunner(gguf, threads=2, module=_fake_module(), probe=True)
    r.prepare(10)
    r.prepare(5000)
    assert calls == [(gguf, 2)]
