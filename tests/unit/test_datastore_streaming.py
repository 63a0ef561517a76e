"""Bounded-memory datastore builds (issue 42): a file larger than the chunk size is read,
decoded and tokenized chunk by chunk, and the ids equal those of a whole-file read whatever
the chunk boundaries cut (multi-byte characters, runs of spaces and newlines, ``\\r\\n``,
words), for word-level, character, byte-level BPE and SentencePiece-style tokenizers; the
build's memory stays bounded and its progress moves."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ragspec.datastore import build_datastore
from ragspec.datastore.builder import _tokenize_inputs
from ragspec.datastore.streaming import ChunkedTokenizer, TextStream, split_complete_lines, utf8_safe_end
from ragspec.errors import ConfigError, DatastoreInputError
from ragspec_testing import make_char_tokenizer

REPO = Path(__file__).resolve().parents[2]

# pieces with awkward places to cut: multi-byte characters (2, 3, 4 bytes, a combining
# accent), runs of spaces, tabs and newlines, \r\n, U+2028, digits, a long word
PIECES = [
    "the cat sat on the mat.  The dog   ran\n\n\nhome\r\n",
    "naïve café — 東京タワー 🐱🐶 e\u0301 \u2028x ",
    "   leading spaces\tand\ttabs\n \n",
    "antidisestablishmentarianism " * 2,
    "1234567890 12 345, (x) 'quoted' \"double\"; ",
    "ünïcödé ñ ß ø 😀😀😀\n",
]


def _text(seed: int, n: int = 2500) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(PIECES) for _ in range(n // 30))


def _train(tk: Tokenizer, vocab: int, **kw) -> PreTrainedTokenizerFast:
    trainer = trainers.BpeTrainer(vocab_size=vocab, max_token_length=16, show_progress=False, **kw)
    tk.train_from_iterator([_text(s) for s in range(20)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>" if "special_tokens" in kw else None)


def _byte_level():  # GPT-2 style
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return _train(tk, 400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


def _llama3_regex():  # Llama 3 / Qwen style: the split regex, then bytes
    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return _train(tk, 500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


def _sentencepiece_like(scheme: str):  # "▁" for spaces, prepended at the start of the input
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=True)
    return _train(tk, 400, special_tokens=["<unk>"])


def _word_level():
    tk = Tokenizer(models.WordLevel({f"w{i}": 1000 + i for i in range(200)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0")


TOKENIZERS = {
    "char": make_char_tokenizer,
    "byte-level BPE": _byte_level,
    "llama3 regex BPE": _llama3_regex,
    "sentencepiece always": lambda: _sentencepiece_like("always"),
    "sentencepiece first": lambda: _sentencepiece_like("first"),
}


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_chunked_tokenization_equals_whole_file_tokenization(name):
    tok = TOKENIZERS[name]()
    for seed in range(6):
        text = _text(100 + seed)
        whole = tok(text, add_special_tokens=False)["input_ids"]
        # windows down to 16 characters (a few tokens), pieces of random sizes: boundaries
        # land inside words, runs of whitespace, \r\n and next to multi-byte characters
        for window in (16, 23, 64, 300):
            chunked = ChunkedTokenizer(tok, window)
            rng = random.Random(seed * 1000 + window)
            i = 0
            while i < len(text):
                k = rng.randint(1, 40)
                chunked.feed(text[i : i + k])
                i += k
            assert chunked.finish().tolist() == whole, (name, seed, window)
            assert window >= 300 or chunked.num_windows > 5  # it really was cut


def test_chunked_tokenizer_edge_cases():
    tok = make_char_tokenizer()
    empty = ChunkedTokenizer(tok, 8)
    assert empty.finish().tolist() == []
    one = ChunkedTokenizer(tok, 8)
    one.feed("ab")
    assert one.finish().tolist() == tok("ab", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError):
        ChunkedTokenizer(tok, 2)


def test_utf8_cuts_decode_as_the_whole_bytes():
    # each cut leaves complete characters and whole invalid sequences on each side
    assert utf8_safe_end(b"ab\xc3") == 2 and utf8_safe_end(b"ab\xc3\xa9") == 4
    assert utf8_safe_end("🐱".encode()[:3]) == 0 and utf8_safe_end(b"\x80\x80\x80\x80") == 4
    rng = random.Random(0)
    valid = "aé東🐱\n ".encode()
    for trial in range(300):
        data = bytes(rng.choice(valid) if rng.random() < 0.9 else rng.randrange(256) for _ in range(rng.randint(0, 60)))
        data = data.replace(b"\0", b"")
        for chunk in (1, 2, 3, 5, 16):
            stream = TextStream(_Bytes(data), chunk)
            assert "".join(stream) == data.decode("utf-8", errors="replace"), (data, chunk)
            assert stream.bytes == len(data)


def test_split_complete_lines_holds_back_a_carriage_return():
    assert split_complete_lines("a\nb\r") == (["a\n"], "b\r")  # the \r may meet a \n next
    text, lines, rest = "x\r\ny\u2028z\n\nw", [], ""
    for ch in text:
        done, rest = split_complete_lines(rest + ch)
        lines += done
    assert lines + [rest] == text.splitlines(keepends=True)


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def read(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out


def _shard_files(path: Path) -> dict[str, bytes]:
    """The shard's files (token ids, suffix array, document offsets, sources) as bytes."""
    return {f.name: f.read_bytes() for f in sorted((path / "shard-00000").iterdir())}


def test_streamed_files_build_the_same_datastore_as_whole_reads(tmp_path):
    tok = _llama3_regex()
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.txt").write_text(_text(1, 4000), encoding="utf-8")
    rows = [{"text": _text(s, 300)} for s in range(12)]
    lines = [json.dumps(r) for r in rows]
    lines[3], lines[7] = "{not json", json.dumps({"other": 1})  # skipped (and counted) either way
    lines.append(json.dumps({"text": "a\u2028b"}, ensure_ascii=False))  # a raw U+2028 ends a line: 2 bad lines
    (src / "b.jsonl").write_text("\r\n".join(lines) + "\n", encoding="utf-8")
    html = "<html><head><title>T</title><style>p {}</style></head><body>" + "".join(
        f"<p>{_text(s, 200)} &amp; &#233;</p><script>var x = '<p>';</script>" for s in range(10)
    )
    (src / "c.html").write_text(html + "</body></html>", encoding="utf-8")
    (src / "d.txt").write_text(" \n\t " * 200)  # whitespace only: no document
    (src / "e.txt").write_bytes(("ok " * 300).encode() + b"\xff" * 2 + ("fine " * 300).encode())  # 2 bad bytes
    whole, streamed = tmp_path / "whole", tmp_path / "streamed"
    info_w = build_datastore([src], whole, tok, progress=False)  # every file under the default chunk size
    info_s = build_datastore([src], streamed, tok, progress=False, chunk_bytes=64)  # all streamed
    assert (info_s.num_tokens, info_s.num_documents) == (info_w.num_tokens, info_w.num_documents)
    assert info_s.skipped_lines == info_w.skipped_lines == 4
    files_w, files_s = _shard_files(whole), _shard_files(streamed)
    assert set(files_w) == {"tokens.bin", "sa.bin", "docs.bin", "sources.json"}
    # the same ids, index and documents; per file the same path, hash, size, documents, skips
    assert files_s == files_w


def test_binary_content_found_late_in_a_streamed_file_drops_it(tmp_path, caplog):
    tok = make_char_tokenizer()
    src = tmp_path / "in"
    src.mkdir()
    (src / "late_nul.txt").write_bytes(b"plain text " * 100 + b"\0" + b"more " * 10)
    (src / "mostly_invalid.txt").write_bytes(b"ok " * 10 + b"\xff\xfe" * 200)
    (src / "good.txt").write_text("good text " * 50)
    info = build_datastore([src], tmp_path / "ds", tok, progress=False, chunk_bytes=64)
    assert info.skipped_files == 2 and info.num_documents == 1
    assert "late_nul.txt: binary content (NUL bytes)" in caplog.text
    sources = json.loads(_shard_files(tmp_path / "ds")["sources.json"])
    by_name = {Path(s["path"]).name: s for s in sources}
    assert by_name["late_nul.txt"]["bytes"] == 1151 and by_name["late_nul.txt"]["num_documents"] == 0
    assert by_name["mostly_invalid.txt"]["skipped"].startswith("binary: ")
    with pytest.raises(DatastoreInputError, match="binary content"):
        build_datastore([src], tmp_path / "ds2", tok, progress=False, chunk_bytes=64, strict=True)
    with pytest.raises(ConfigError):
        build_datastore([src], tmp_path / "ds3", tok, progress=False, chunk_bytes=8)


def test_progress_moves_while_one_large_file_is_read(tmp_path, monkeypatch):
    import tqdm

    updates: list[int] = []

    class Bar:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def update(self, n: int) -> None:
            updates.append(n)

        def set_postfix(self, **kwargs) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    (tmp_path / "big.txt").write_text("word " * 2000)
    _tokenize_inputs([tmp_path / "big.txt"], make_char_tokenizer(), "text", True, None, chunk_bytes=1000)
    assert len(updates) == 10 and sum(updates) == 10_000  # byte by byte as it is read, not at the end


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak RSS read from /proc (Linux)")
def test_large_single_file_builds_in_bounded_memory(tmp_path):
    # one text file 20x the chunk size: the whole-file read held its bytes, its text and the
    # tokenizer's encoding of all of it (about 180 MB here, 550 bytes a token); streamed, the
    # build holds a chunk's text and encoding plus the token ids (int arrays): about 14 MB
    chunk = 64 * 1024
    big = tmp_path / "big.txt"
    rng = np.random.default_rng(0)
    words = rng.integers(0, 200, size=20 * chunk // 4)
    big.write_text(" ".join(f"w{i}" for i in words))
    assert big.stat().st_size >= 20 * chunk
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_datastore_streaming import _word_level
        from ragspec.datastore import build_datastore

        def kib(field):  # from /proc/self/status: VmRSS now, VmHWM its peak
            for line in open("/proc/self/status"):
                if line.startswith(field + ":"):
                    return int(line.split()[1])

        tok = _word_level()
        (small := {str(tmp_path / "small.txt")!r}) and open(small, "w").write("w1 w2 " * 100)
        build_datastore([small], {str(tmp_path / "warm")!r}, tok, progress=False, chunk_bytes={chunk})
        base = kib("VmRSS")
        try:  # reset the peak to now (Linux >= 4.0), so the import's own peak does not hide ours
            open("/proc/self/clear_refs", "w").write("5")
        except OSError:
            pass
        info = build_datastore([{str(big)!r}], {str(tmp_path / "ds")!r}, tok, progress=False, chunk_bytes={chunk})
        peak = kib("VmHWM")
        print(info.num_tokens, (peak - base) * 1024)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    num_tokens, grown = map(int, out.stdout.split()[-2:])
    assert num_tokens == len(words)
    # the token ids (a few int32/int64 arrays: about 40 bytes a token) and a constant
    limit = 16 * 2**20 + 40 * num_tokens
    assert grown < limit, f"peak RSS grew {grown / 2**20:.1f} MiB for {num_tokens} tokens (limit {limit / 2**20:.1f})"
