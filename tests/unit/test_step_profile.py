"""ragspec bench --profile-step: the parts of a plain step on a tiny random model."""

import pytest
import torch

from ragspec.backend.hf import HFTarget
from ragspec.bench.profile import format_step_profile, profile_plain_step
from ragspec.cli import main as cli_main
from ragspec.engine import Engine


def test_profile_plain_step_splits_a_step(no_eos_setup, char_tokenizer, single_thread):
    model, _, _ = no_eos_setup
    engine = Engine(HFTarget(model), char_tokenizer, eos_token_ids=())
    prof = profile_plain_step(engine, list(range(5, 30)), steps=6)
    parts = ("embed_rope", "layers", "logits", "argmax")
    assert all(prof[k] >= 0.0 for k in parts) and prof["layers"] > 0.0
    assert prof["target_step"] == pytest.approx(sum(prof[k] for k in parts))
    assert prof["engine_step"] > 0.0 and prof["context"] == 25.0 and prof["steps"] == 6.0
    text = format_step_profile("tiny", prof)
    assert text.startswith("tiny: context 25 tokens, 6 plain steps") and "engine_overhead" in text
    assert not torch.is_inference_mode_enabled()


def test_profile_step_negative_is_a_usage_error_before_loading(tmp_path, capsys):
    data = tmp_path / "none.jsonl"  # never read: the check comes first
    assert cli_main(["bench", "--data", str(data), "--profile-step", "-3"]) == 2
    assert "--profile-step" in capsys.readouterr().err
