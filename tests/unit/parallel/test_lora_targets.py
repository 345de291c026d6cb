"""parallel.lora without megatron: target names (HF/PEFT and megatron) and the layout-independent init."""
from __future__ import annotations

import pytest
import torch

from parallel.lora import _init_a, resolve_targets
from parallel.lora_export import peft_target_modules


def test_targets_map_hf_names_to_megatron_layers():
    assert resolve_targets("all-linear") == ("linear_qkv", "linear_fc1", "linear_proj", "linear_fc2")
    assert resolve_targets(["q_proj", "k_proj", "v_proj", "o_proj"]) == ("linear_qkv", "linear_proj")
    assert resolve_targets(["gate_proj", "up_proj", "down_proj", "linear_proj"]) == (
        "linear_fc1", "linear_proj", "linear_fc2")
    assert peft_target_modules(("linear_qkv", "linear_fc2")) == ["down_proj", "k_proj", "q_proj", "v_proj"]


@pytest.mark.parametrize("bad, says", [(["q_proj", "v_proj"], "without ['k_proj']"), (["lm_head"], "'lm_head' is not"),
                                       ([], "target_modules is empty"), (["gate_proj"], "without ['up_proj']")])
def test_bad_targets_are_named(bad, says):
    with pytest.raises(ValueError, match=None) as ei:
        resolve_targets(bad)
    assert says in str(ei.value)


def test_init_is_layout_independent_and_bounded():
    a = _init_a((4, 64), "xavier", "layers.3.self_attention.linear_proj", 0)
    assert torch.equal(a, _init_a((4, 64), "xavier", "layers.3.self_attention.linear_proj", 0))
    assert not torch.equal(a, _init_a((4, 64), "xavier", "layers.2.self_attention.linear_proj", 0))
    assert float(a.abs().max()) <= (6 / (4 + 64)) ** 0.5
    assert float(_init_a((4, 64), "kaiming", "k", 0).abs().max()) <= 1 / 8
