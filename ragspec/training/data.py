"""The training data of an EAGLE draft head: steps 1 and 2 of the recipe in
:mod:`ragspec.training.pipeline`.

The prompts of Spec-Bench style JSONL files (the rows the benchmark uses held out), the
target's own greedy and sampled responses to some of them, and the target's last hidden
states (the features) over every sequence, cached in the work folder; and the head's
draft vocabulary, chosen from the data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ..errors import ConfigError
from ..specbench import category_group

logger = logging.getLogger(__name__)

__all__ = [
    "DataConfig",
    "TrainSequence",
    "load_prompt_texts",
    "generate_responses",
    "generate_responses_with_engine",
    "extract_features",
    "choose_draft_vocab",
    "build_dataset",
]


@dataclass(frozen=True)
class DataConfig:
    """Which text the head is trained on."""

    paths: tuple[str, ...] = ()
    """JSONL files: Spec-Bench rows (``turns``) or rows with a ``text`` field."""
    holdout_per_category: int = 5
    """First rows of each category group left out (what ``ragspec bench --limit N`` runs);
    0 keeps every row."""
    num_responses: int = 64
    """Prompts (spread over the categories) that get the target's greedy response appended."""
    num_samples: int = 0
    """Extra *sampled* responses per such prompt (each its own sequence): more of the
    target's own text, the data EAGLE's self-distillation wants."""
    sample_temperature: float = 0.8
    """Temperature of the sampled responses (top-p 0.95)."""
    response_tokens: int = 128
    """Most tokens of each generated response."""
    generation_batch: int = 8
    """Prompts generated together (left-padded batch)."""
    max_tokens: int = 0
    """Most tokens of text in total (0 = all); sequences past the budget are dropped."""
    max_seq_len: int = 2048
    """Longer sequences are cut (features need the whole sequence in one forward)."""

    def __post_init__(self) -> None:
        if self.holdout_per_category < 0 or self.num_responses < 0 or self.max_tokens < 0 or self.num_samples < 0:
            raise ConfigError("holdout_per_category, num_responses, num_samples and max_tokens must be >= 0")
        if not self.sample_temperature > 0:
            raise ConfigError(f"sample_temperature must be > 0, got {self.sample_temperature}")
        if self.response_tokens < 1 or self.generation_batch < 1 or self.max_seq_len < 2:
            raise ConfigError("response_tokens and generation_batch must be >= 1, max_seq_len >= 2")


@dataclass
class TrainSequence:
    """One training sequence.

    Attributes:
        ids: token ids [L].
        prompt_len: tokens of the prompt (the rest is the generated response).
        source: where it comes from (``file:row`` and ``+response``).
    """

    ids: list[int]
    prompt_len: int
    source: str = ""


# --------------------------------------------------------------------------- text
def _sha256(path: Path) -> str:
    d = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            d.update(block)
    return d.hexdigest()


def load_prompt_texts(
    paths: Sequence[str], tokenizer, holdout_per_category: int = 5
) -> tuple[list[TrainSequence], dict]:
    """Token sequences of the prompts in ``paths``.

    Spec-Bench rows (``turns``): the first turn as a chat user message, through the chat
    template with the generation prompt (what the engine feeds the model). Rows with a
    ``text`` field: the text, tokenized without special tokens.

    Returns:
        (sequences, record): ``record`` names each file's sha256, rows used, and the
        held-out ``question_id`` s.

    Raises:
        ConfigError: a missing file, a bad line, or no text at all.
    """
    seqs: list[TrainSequence] = []
    files = []
    held_out: list = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"training data not found: {p}")
        per_group: dict[str, int] = {}
        used = 0
        with p.open(encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{p}:{i}: not valid JSON ({e})") from e
                if "turns" in row:
                    g = category_group(str(row.get("category", "")))
                    per_group[g] = per_group.get(g, 0) + 1
                    if per_group[g] <= holdout_per_category:
                        held_out.append(row.get("question_id"))
                        continue
                    content = str(row["turns"][0])
                    if getattr(tokenizer, "chat_template", None):
                        text = tokenizer.apply_chat_template(
                            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
                        )
                        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                    else:
                        ids = tokenizer(content)["input_ids"]
                    src = f"{p.name}:{row.get('category', '')}:{row.get('question_id', i)}"
                elif "text" in row:
                    ids = tokenizer(str(row["text"]), add_special_tokens=False)["input_ids"]
                    src = f"{p.name}:{i}"
                else:
                    raise ConfigError(f"{p}:{i}: a row needs 'turns' (Spec-Bench) or 'text'")
                if len(ids) >= 2:
                    seqs.append(TrainSequence(list(ids), len(ids), src))
                    used += 1
        files.append({"path": str(p), "sha256": _sha256(p), "rows_used": used})
    if not seqs:
        raise ConfigError("no training text in " + ", ".join(map(str, paths)))
    return seqs, {"files": files, "held_out_question_ids": held_out}


def _spread(seqs: Sequence[TrainSequence], n: int) -> list[int]:
    """Indices of ``n`` sequences spread over the categories (round robin over the source
    groups, in file order)."""
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(seqs):
        groups.setdefault(s.source.rsplit(":", 1)[0], []).append(i)
    order: list[int] = []
    lists = list(groups.values())
    j = 0
    while len(order) < min(n, len(seqs)):
        for lst in lists:
            if j < len(lst) and len(order) < n:
                order.append(lst[j])
        j += 1
    return order


def generate_responses(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    batch_size: int = 8,
    progress: Optional[Callable[[int], None]] = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[list[int]]:
    """Greedy (``temperature`` 0) or sampled (top-p 0.95) responses of ``model`` to
    ``prompts``, in batches of similar length (left-padded; the attention mask hides the
    padding). Sampling goes through ``model.generate``, which draws from the global torch
    RNG of the model's device: it is seeded with ``seed`` here (training tool only).

    Returns:
        one list of token ids per prompt (cut after the first EOS, which is kept).
    """
    eos = [int(e) for e in eos_token_ids]
    pad = eos[0] if eos else 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    dev = next(model.parameters()).device
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = list(prompts[i])
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        sample_kw: dict[str, Any] = dict(do_sample=False)
        if temperature > 0:
            torch.manual_seed(seed + b)
            sample_kw = dict(do_sample=True, temperature=temperature, top_p=0.95, top_k=0)
        with torch.inference_mode():
            gen = model.generate(
                ids.to(dev),
                attention_mask=mask.to(dev),
                max_new_tokens=max_new_tokens,
                **sample_kw,
                eos_token_id=eos or None,
                pad_token_id=pad,
            )
        for r, i in enumerate(idx):
            toks = gen[r, width:].tolist()
            for j, t in enumerate(toks):
                if t in eos:
                    toks = toks[: j + 1]
                    break
            out[i] = toks
        if progress:
            progress(len(idx))
    return out


def generate_responses_with_engine(
    engine,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    in_flight: int = 8,
    progress: Optional[Callable[[int], None]] = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[list[int]]:
    """:func:`generate_responses` through ragspec's own batched engine step (``in_flight``
    requests verified per forward, with speculation): greedy output is token-identical to
    ``model.generate``'s, sampled output (top-p 0.95) has the target's distribution and
    is reproducible (request ``i`` seeded ``seed + i``). On a 2-core CPU several times
    faster than left-padded ``model.generate`` batches of long prompts.

    Args:
        engine: a :class:`~ragspec.engine.Engine` for the target (its model, any drafters).
        prompts: token ids per prompt (chat template applied already).

    Returns:
        one list of token ids per prompt (ending with EOS when the response ended there).

    Raises:
        ConfigError: ``in_flight`` < 1.
    """
    out: list[list[int]] = [[] for _ in prompts]

    def start(i: int):
        return lambda: engine.request(
            list(prompts[i]),
            max_new_tokens=max_new_tokens,
            chat=False,
            temperature=temperature,
            top_p=0.95 if temperature > 0 else 1.0,
            seed=seed + i,
        )

    for step in engine.run_requests([start(i) for i in range(len(prompts))], in_flight):
        for i, chunk in step:
            out[i].extend(chunk.token_ids)
            if chunk.finish_reason is not None and progress:
                progress(1)
    return out


def extract_features(
    model, seqs: Sequence[TrainSequence], *, progress: Optional[Callable[[int], None]] = None
) -> list[torch.Tensor]:
    """The target's last hidden states (after the final norm) for each sequence, from one
    teacher-forced forward each: bfloat16 [L, H] on the CPU per sequence."""
    decoder = model.get_decoder()
    dev = next(model.parameters()).device
    feats = []
    with torch.inference_mode():
        for s in seqs:
            ids = torch.tensor([s.ids], dtype=torch.long, device=dev)  # [1, L]
            hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state[0]  # [L, H]
            feats.append(hidden.to("cpu", torch.bfloat16))
            if progress:
                progress(len(s.ids))
    return feats


def choose_draft_vocab(seqs: Sequence[TrainSequence], vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` tokens the head drafts from: the tokens of the data by decreasing count
    (ties by id), then the lowest ids not seen (BPE ids roughly follow merge order, so
    frequency). int64 [size], sorted; all ids when ``size`` is 0 or >= ``vocab_size``."""
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size, dtype=torch.long)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        t = torch.tensor(s.ids, dtype=torch.long)
        counts += torch.bincount(t.clamp(0, vocab_size - 1), minlength=vocab_size)
    # count first, then a small preference for low ids among equal counts
    key = counts.double() * vocab_size + (vocab_size - 1 - torch.arange(vocab_size, dtype=torch.double))
    top = torch.topk(key, size).indices
    return torch.sort(top).values


# --------------------------------------------------------------------------- the dataset
# --------------------------------------------------------------------------- the whole pipeline
def _data_key(info: dict, data: DataConfig, files: list) -> str:
    blob = json.dumps({"target": info["fingerprint"], "data": asdict(data), "files": files}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _within_budget(seqs: Sequence[TrainSequence], max_seq_len: int, max_tokens: int) -> tuple[list[TrainSequence], int]:
    """(sequences, their tokens): each of ``seqs`` cut to ``max_seq_len`` tokens, in order,
    those past ``max_tokens`` in total dropped (0: no budget)."""
    out, total = [], 0
    for s in seqs:
        s = TrainSequence(s.ids[:max_seq_len], min(s.prompt_len, max_seq_len), s.source)
        if max_tokens and total + len(s.ids) > max_tokens:
            continue
        out.append(s)
        total += len(s.ids)
    return out, total


def build_dataset(
    model,
    tokenizer,
    eos_ids,
    info: dict,
    data: DataConfig,
    work_dir: Path,
    progress: bool = True,
    engine_factory: Optional[Callable[[], object]] = None,
) -> dict:
    """Text, responses and features (cached in ``work_dir/features.pt``, keyed by the
    target fingerprint, the data settings and the files' sha256). ``engine_factory``:
    builds a ragspec engine to generate the responses with
    (:func:`generate_responses_with_engine`), called only when responses are generated;
    None: left-padded ``model.generate`` batches."""
    from tqdm.auto import tqdm

    seqs, record = load_prompt_texts(data.paths, tokenizer, data.holdout_per_category)
    key = _data_key(info, data, record["files"])
    cache = work_dir / "features.pt"
    if cache.is_file():
        blob = torch.load(cache, weights_only=False)
        if blob.get("key") == key:
            logger.info("reusing features from %s", cache)
            return blob
    t0 = time.perf_counter()
    chosen = _spread(seqs, data.num_responses)
    prompts = [seqs[i].ids for i in chosen]
    bar = tqdm(total=len(prompts), desc="greedy responses", disable=not progress or not prompts, unit="prompt")
    engine = engine_factory() if engine_factory is not None and prompts else None

    def respond(temperature: float, seed: int, update) -> list[list[int]]:
        if engine is not None:
            return generate_responses_with_engine(
                engine,
                prompts,
                max_new_tokens=data.response_tokens,
                in_flight=data.generation_batch,
                progress=update,
                temperature=temperature,
                seed=seed,
            )
        return generate_responses(
            model,
            prompts,
            max_new_tokens=data.response_tokens,
            eos_token_ids=eos_ids,
            batch_size=data.generation_batch,
            progress=update,
            temperature=temperature,
            seed=seed,
        )

    responses = respond(0.0, 0, bar.update)
    bar.close()
    sampled: list[TrainSequence] = []
    for k in range(data.num_samples):
        bar = tqdm(
            total=len(prompts),
            desc=f"sampled responses {k + 1}/{data.num_samples}",
            disable=not progress,
            unit="prompt",
        )
        resp_k = respond(data.sample_temperature, 1000 * (k + 1), bar.update)
        bar.close()
        for i, resp in zip(chosen, resp_k):
            sampled.append(TrainSequence(seqs[i].ids + resp, seqs[i].prompt_len, seqs[i].source + f"+sample{k}"))
            responses.append(resp)
    gen_s = time.perf_counter() - t0
    for i, resp in zip(chosen, responses):
        seqs[i] = TrainSequence(seqs[i].ids + resp, seqs[i].prompt_len, seqs[i].source + "+response")
    out, total = _within_budget(seqs + sampled, data.max_seq_len, data.max_tokens)
    t1 = time.perf_counter()
    bar = tqdm(total=total, desc="target features", disable=not progress, unit="tok")
    feats = extract_features(model, out, progress=bar.update)
    bar.close()
    record.update(
        {
            "num_sequences": len(out),
            "num_tokens": total,
            "num_responses": len(chosen),
            "num_sampled_responses": len(sampled),
            "num_response_tokens": sum(len(r) for r in responses),
            "generation_s": gen_s,
            "features_s": time.perf_counter() - t1,
        }
    )
    blob = {"key": key, "seqs": [asdict(s) for s in out], "features": feats, "record": record}
    work_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, cache)
    return blob
