"""The backend is chosen once, in ragspec.loading.select_target, from the model's device:
the CPU backend (its speed-ups installed) on the CPU, the device-neutral transformers target
elsewhere. Devices other than the CPU are stood in for by PyTorch's "meta" device (no data,
no forward: only the choice is checked)."""

from __future__ import annotations

import pytest

from ragspec.backend.attention import GQA_SDPA
from ragspec.backend.base import Capability, Target
from ragspec.backend.cpu.target import CPUTarget
from ragspec.backend.hf import HFTarget
from ragspec.errors import ConfigError
from ragspec.loading import select_target
from ragspec_testing import make_tiny_llama


def test_cpu_model_gets_the_cpu_backend_with_its_speed_ups():
    target = select_target(make_tiny_llama(layers=1), cpu_kernels=False)
    assert type(target) is CPUTarget and isinstance(target, Target) and target.numerics == "exact"
    # built with its speed-ups: oneDNN-packed linears (where oneDNN is built in) and the
    # attention routed
    assert target.attention_routed and target._attn_impl == GQA_SDPA
    assert target.skinny is None  # cpu_kernels=False
    speed_ups = target.capability(Capability.SPEED_UPS)
    assert not speed_ups.compiled_kernel and not speed_ups.batched_verify and speed_ups.gguf_weights == 0
    assert "switched off" in speed_ups.native_step_off


def test_speed_ups_off_gives_the_backend_for_the_device_untouched():
    target = select_target(make_tiny_llama(layers=1), speed_ups=False)
    assert type(target) is CPUTarget
    assert target.packed_linears == 0 and target.skinny is None and target._attn_impl == "sdpa"
    assert target.capability(Capability.SPEED_UPS).native_step_off == "built without the CPU speed-ups"


def test_other_devices_get_the_device_neutral_target():
    model = make_tiny_llama(layers=1).to("meta")
    target = select_target(model)
    assert type(target) is HFTarget and target.numerics == "exact"
    assert target.attention_routed and target._attn_impl == GQA_SDPA
    assert target.capability(Capability.FAST_LINEAR) is None
    assert target.capability(Capability.SPEED_UPS) is None  # nothing to report
    with pytest.raises(ConfigError, match="numerics fast"):
        select_target(make_tiny_llama(layers=1).to("meta"), numerics="fast")


def test_unknown_numerics_and_a_cpu_backend_off_the_cpu_are_refused():
    with pytest.raises(ConfigError, match="numerics must be one of"):
        select_target(make_tiny_llama(layers=1), numerics="approximate")
    with pytest.raises(ConfigError, match="on the CPU"):
        CPUTarget(make_tiny_llama(layers=1).to("meta"))


def test_the_cuda_backend_can_be_switched_off_by_name(monkeypatch):
    # RAGSPEC_CUDA_BACKEND=0 (or use_cuda_backend=False) keeps transformers' forwards on CUDA,
    # with the reason logged; on by default, where the backend runs the model
    from ragspec import loading

    model = make_tiny_llama()
    monkeypatch.setenv("RAGSPEC_CUDA_BACKEND", "0")
    assert loading._cuda_backend_unavailable(model, None) == "switched off: RAGSPEC_CUDA_BACKEND=0"
    assert loading._cuda_backend_unavailable(model, False) == "switched off: RAGSPEC_CUDA_BACKEND=0"
    monkeypatch.delenv("RAGSPEC_CUDA_BACKEND")
    pytest.importorskip("triton")
    assert loading._cuda_backend_unavailable(model, True) is None  # triton installed, a Llama
