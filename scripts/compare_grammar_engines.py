"""Compare the two grammar engines ragspec could constrain with, xgrammar and llguidance,
on the default model's tokenizer: compile seconds per schema, mask seconds per token (the
time a constrained decoding step spends on the grammar), and the draft-tree walk
(consume + rollback per node) speculation needs. Both engines run interleaved, token by
token, so machine load hits them alike.

    python scripts/compare_grammar_engines.py [--model smollm2-135m-instruct] [--reps 3]

Prints one table; the figures are indicative only on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMAS = {
    "answer_quotes": {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "quotes": {"type": "array", "items": {"type": "string"}}},
        "required": ["answer", "quotes"],
        "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "hourly": {"type": "boolean"},
        },
        "required": ["city", "unit", "days"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "authors": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "email": {"type": "string", "format": "email"}},
                    "required": ["name"],
                },
            },
            "year": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        },
        "required": ["title", "authors", "year"],
    },
}

TEXTS = {
    "answer_quotes": json.dumps(
        {
            "answer": "The Eiffel Tower was completed in 1889 for the World's Fair in Paris.",
            "quotes": ["The tower was completed in March 1889.", "It was built for the 1889 Exposition Universelle."],
        }
    ),
    "tool_call": json.dumps({"city": "San Francisco", "unit": "celsius", "days": 7, "hourly": True}),
    "nested": json.dumps(
        {
            "title": "Speculative decoding for retrieval",
            "authors": [{"name": "Ada Lovelace", "email": "ada@example.org"}, {"name": "Alan Turing"}],
            "year": 2024,
            "tags": ["decoding", "retrieval"],
        }
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model name or folder (default: ragspec's default model)")
    ap.add_argument("--reps", type=int, default=3, help="passes over each text")
    args = ap.parse_args()

    import llguidance
    import llguidance.hf
    import llguidance.torch
    import xgrammar as xgr

    from ragspec.models.registry import resolve_model
    from ragspec.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(args.model))
    vocab = len(tok)
    x_info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    x_comp = xgr.GrammarCompiler(x_info, max_threads=1, cache_enabled=False)
    l_tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    print(f"vocabulary {vocab} tokens")
    print(f"{'schema':14} {'engine':11} {'compile ms':>10} {'mask us/tok':>12} {'max us':>8} {'walk us/node':>13}")
    for name, schema in SCHEMAS.items():
        ids = tok.encode(TEXTS[name], add_special_tokens=False)
        t0 = time.perf_counter()
        x_g = x_comp.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        x_compile = time.perf_counter() - t0
        t0 = time.perf_counter()
        l_g = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        )
        l_probe = llguidance.LLMatcher(l_tok, l_g)
        l_compile = time.perf_counter() - t0
        if l_probe.is_error():
            raise SystemExit(f"llguidance: {l_probe.get_error()}")
        x_mask = xgr.allocate_token_bitmask(1, vocab)
        l_mask = llguidance.torch.allocate_token_bitmask(1, l_tok.vocab_size)
        x_times: list[float] = []
        l_times: list[float] = []
        x_walk: list[float] = []
        l_walk: list[float] = []
        for _ in range(args.reps):
            xm = xgr.GrammarMatcher(x_g)
            lm = llguidance.LLMatcher(l_tok, l_g)
            for t in ids:
                t0 = time.perf_counter()
                xm.fill_next_token_bitmask(x_mask)
                x_times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                llguidance.torch.fill_next_token_bitmask(lm, l_mask)
                l_times.append(time.perf_counter() - t0)
                if not xm.accept_token(t) or not lm.consume_token(t):
                    raise SystemExit(f"{name}: token {t} {tok.decode([t])!r} rejected")
            # the draft walk: 8 tokens consumed then rolled back, from the start state
            xm, lm = xgr.GrammarMatcher(x_g), llguidance.LLMatcher(l_tok, l_g)
            for start in range(0, len(ids) - 8):
                head, chain = ids[:start], ids[start : start + 8]
                t0 = time.perf_counter()
                for t in chain:
                    xm.accept_token(t)
                xm.rollback(len(chain))
                x_walk.append((time.perf_counter() - t0) / len(chain))
                t0 = time.perf_counter()
                n = lm.validate_tokens(chain)
                l_walk.append((time.perf_counter() - t0) / len(chain))
                assert n == len(chain), (n, chain)
                xm.accept_token(ids[start])
                lm.consume_token(ids[start])
                del head
        for engine, compile_s, times, walk in (
            ("xgrammar", x_compile, x_times, x_walk),
            ("llguidance", l_compile, l_times, l_walk),
        ):
            print(
                f"{name:14} {engine:11} {compile_s * 1e3:10.1f} {statistics.median(times) * 1e6:12.1f} "
                f"{max(times) * 1e6:8.0f} {statistics.median(walk) * 1e6:13.1f}"
            )
    torch.set_num_threads(1)


if __name__ == "__main__":
    main()
