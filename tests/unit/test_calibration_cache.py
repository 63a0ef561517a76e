"""The latency table cached across starts (issue 42, fast restarts): a hit skips the
measurement, any change of the key measures anew, a damaged file is ignored with a warning,
``recalibrate`` forces; and through ``load_engine``, a restart on a warm cache never
calibrates."""

from __future__ import annotations

import dataclasses
import logging

import pytest

import ragspec.loading
from ragspec.calibration_cache import (
    CalibrationCache,
    CalibrationKey,
    cached_latency,
    files_fingerprint,
    machine_fingerprint,
)
from ragspec.policy import LatencyModel
from ragspec_testing import make_char_tokenizer, make_tiny_llama

KEY = CalibrationKey(
    machine="x86_64|Test CPU|flags:abc|cpus:2|gpu:",
    model="hf|/models/tiny|0123",
    device="cpu",
    dtype="torch.float32",
    threads=2,
    kernels="torch-2.x|exact",
)


class FakeMeasure:
    """A measurement that counts its calls and returns a fixed table (seconds per q)."""

    def __init__(self, table=None, early=None):
        self.calls = 0
        self.table = table or {1: 0.010, 2: 0.012, 4: 0.015}
        self.early = early

    def __call__(self) -> LatencyModel:
        self.calls += 1
        return LatencyModel(dict(self.table), early=dict(self.early) if self.early else None)


def test_cache_hit_skips_the_measurement(tmp_path):
    cache = CalibrationCache(tmp_path / "calibration")
    measure = FakeMeasure(early={1: 0.006, 2: 0.008, 4: 0.011})
    first = cached_latency(measure, KEY, cache)
    assert measure.calls == 1 and cache.path(KEY).is_file()
    again = cached_latency(measure, KEY, cache)
    assert measure.calls == 1  # served from the file
    assert again.table == first.table == pytest.approx(measure.table)
    assert again.early_table == pytest.approx({1: 0.006, 2: 0.008, 4: 0.011})
    assert again(3) == pytest.approx(first(3))


@pytest.mark.parametrize(
    "change",
    [
        {"machine": "x86_64|Other CPU|flags:def|cpus:2|gpu:"},
        {"model": "hf|/models/tiny|4567"},  # the weights changed (size or mtime)
        {"dtype": "torch.bfloat16"},
        {"threads": 4},
        {"kernels": "torch-2.x|fast"},
        {"device": "cuda:0"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_a_changed_key_measures_anew(tmp_path, change):
    cache = CalibrationCache(tmp_path)
    measure = FakeMeasure()
    cached_latency(measure, KEY, cache)
    cached_latency(measure, dataclasses.replace(KEY, **change), cache)
    assert measure.calls == 2
    cached_latency(measure, KEY, cache)  # the first key's table is still there
    assert measure.calls == 2


def test_recalibrate_measures_even_on_a_hit_and_replaces_the_table(tmp_path):
    cache = CalibrationCache(tmp_path)
    cached_latency(FakeMeasure({1: 0.010, 2: 0.012}), KEY, cache)
    slower = FakeMeasure({1: 0.020, 2: 0.024})
    assert cached_latency(slower, KEY, cache, recalibrate=True).table == pytest.approx({1: 0.020, 2: 0.024})
    assert slower.calls == 1
    assert cache.get(KEY).table == pytest.approx({1: 0.020, 2: 0.024})


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",  # a torn write
        b"\xff\xfe\x00garbage",  # not text
        b'{"key": null, "table": {"1": 0.01}}',  # another key
        b"[]",
        b'{"key": KEY, "table": {"1": -1.0}}',  # a negative latency
        b'{"key": KEY, "table": {"2": 0.01}}',  # no q = 1
        b'{"key": KEY, "table": "fast"}',
    ],
)
def test_a_corrupt_cache_file_is_ignored_with_a_warning(tmp_path, caplog, content):
    cache = CalibrationCache(tmp_path)
    import json

    cache.path(KEY).write_bytes(content.replace(b"KEY", json.dumps(KEY.to_dict()).encode()))
    measure = FakeMeasure()
    with caplog.at_level(logging.WARNING, logger="ragspec.calibration_cache"):
        latency = cached_latency(measure, KEY, cache)
    assert measure.calls == 1 and latency.table == pytest.approx(measure.table)
    assert any("ignoring the cached latency table" in r.getMessage() for r in caplog.records)
    assert cache.get(KEY) is not None  # measured over: the next start hits


def test_an_unwritable_cache_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = CalibrationCache(blocker / "calibration")  # under a file: cannot be created
    measure = FakeMeasure()
    with caplog.at_level(logging.WARNING, logger="ragspec.calibration_cache"):
        cached_latency(measure, KEY, cache)
        cached_latency(measure, KEY, cache)
    assert measure.calls == 2
    assert any("cannot cache the latency table" in r.getMessage() for r in caplog.records)


def test_fingerprints_follow_the_files_and_the_cpu(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"1234")
    before = files_fingerprint(folder)
    assert files_fingerprint(folder) == before
    (folder / "model.safetensors").write_bytes(b"123456")  # another size
    assert files_fingerprint(folder) != before
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2\n")
    one = machine_fingerprint(cpuinfo)
    assert "Test CPU" in one
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 avx512f\n")
    assert machine_fingerprint(cpuinfo) != one  # another ISA: another table
    assert machine_fingerprint(cpuinfo, gpu="NVIDIA H200") != machine_fingerprint(cpuinfo)


def test_restart_on_a_warm_cache_does_not_calibrate(tmp_path, monkeypatch):
    """Through ``load_engine``: the first start measures, a restart (same machine, model,
    dtype, threads, kernels) takes the cached table and never calls the measurement;
    ``recalibrate`` and a changed model measure again."""
    import torch

    from ragspec.loading import load_engine

    tok = make_char_tokenizer()
    folder = tmp_path / "tiny"
    make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3, eos_token_id=None).save_pretrained(folder)
    tok.save_pretrained(folder)
    calls = []

    def fake_measure(target, *args, **kwargs):
        calls.append(target)
        return LatencyModel({1: 0.01, 2: 0.011, 4: 0.013})

    monkeypatch.setattr(ragspec.loading, "measure_latency_model", fake_measure)
    monkeypatch.delenv("RAGSPEC_RECALIBRATE", raising=False)
    cache = tmp_path / "cache"

    def start(**kw):
        return load_engine(str(folder), "cpu", eagle="none", cache=cache, cpu_kernels=False, **kw)

    engine = start()
    assert len(calls) == 1 and list((cache / "calibration").glob("latency-*.json"))
    restarted = start()
    assert len(calls) == 1  # warm cache: no calibration
    assert restarted.latency.table == pytest.approx(engine.latency.table)
    start(recalibrate=True)
    assert len(calls) == 2
    monkeypatch.setenv("RAGSPEC_RECALIBRATE", "1")
    start()
    assert len(calls) == 3
    monkeypatch.delenv("RAGSPEC_RECALIBRATE")
    old = torch.get_num_threads()
    torch.set_num_threads(1 if old != 1 else 2)
    try:
        start()  # other threads: another table
    finally:
        torch.set_num_threads(old)
    assert len(calls) == 4
    (folder / "config.json").write_text((folder / "config.json").read_text() + "\n")  # the model changed
    start()
    assert len(calls) == 5
    start(calibrate=False)
    assert len(calls) == 5
