"""Context parallelism: the split (megatron's), the padding multiple, the refusal without TE, the layout in
the config checks and the memory plan.  The distributed part (forward_backward at TP2 x CP2 vs CP1,
outputs and gradients) is a check of tests/e2e/test_foundation_dist.py."""
import dataclasses

import pytest
import torch

from parallel.context_parallel import local_positions, seq_length_multiple, split_for_context_parallel
from parallel.model_config import check_context_parallel


@pytest.mark.parametrize("S,cp,rank,expected", [
    (8, 2, 0, [0, 1, 6, 7]), (8, 2, 1, [2, 3, 4, 5]),
    (16, 4, 0, [0, 1, 14, 15]), (16, 4, 1, [2, 3, 12, 13]), (16, 4, 3, [6, 7, 8, 9]),
    (5, 1, 0, [0, 1, 2, 3, 4]),
])
def test_local_positions_by_hand(S, cp, rank, expected):
    assert local_positions(S, cp, rank).tolist() == expected


@pytest.mark.parametrize("cp", [2, 4])
def test_local_positions_match_megatrons_split(monkeypatch, cp):
    """Our index map (used by the gather's backward) is exactly megatron's get_batch_on_this_cp_rank."""
    from megatron.core import parallel_state as ps

    S = 8 * cp
    full = torch.arange(3 * S).view(3, S)
    seen = []
    for rank in range(cp):
        monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda: cp)
        monkeypatch.setattr(ps, "get_context_parallel_rank", lambda r=rank: r)
        part = split_for_context_parallel({"x": full, "none": None})
        assert part["none"] is None
        assert torch.equal(part["x"], full[:, local_positions(S, cp, rank)])
        seen += local_positions(S, cp, rank).tolist()
    assert sorted(seen) == list(range(S))  # every token on exactly one rank


def test_local_positions_refuse_a_length_that_does_not_split():
    with pytest.raises(ValueError, match="not a multiple of 2 \\* context_parallel_size = 4"):
        local_positions(10, 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2"):
        local_positions(8, 2, 2)


def test_seq_length_multiple():
    assert seq_length_multiple(1) == 1 and seq_length_multiple(1, 4, True) == 4 and seq_length_multiple(1, 4) == 1
    assert seq_length_multiple(2) == 4 and seq_length_multiple(4) == 8
    assert seq_length_multiple(2, 2, True) == 4  # each rank's 2 chunks: S/cp a multiple of tp
    assert seq_length_multiple(2, 4, True) == 8 and seq_length_multiple(2, 3, True) == 12


def test_context_parallel_needs_transformer_engine():
    check_context_parallel(1, use_te=False)
    check_context_parallel(2, use_te=True)
    with pytest.raises(ValueError, match="context_parallel_size=2 needs Transformer Engine.*"
                                         "parallel.context_parallel_size=1"):
        check_context_parallel(2, use_te=False)
    with pytest.raises(ValueError, match="context_parallel_size=0"):
        check_context_parallel(0, use_te=True)


def test_transformer_config_refuses_cp_on_the_local_spec():
    from transformers import LlamaConfig

    from parallel.model_config import transformer_config_from_hf

    hf = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128)
    assert transformer_config_from_hf(hf, use_te=False).context_parallel_size == 1
    with pytest.raises(ValueError, match="needs Transformer Engine"):
        transformer_config_from_hf(hf, cp=2, use_te=False)


def test_world_size_check_counts_cp():
    from parallel.distributed import check_parallel_sizes

    check_parallel_sizes(8, tp=2, pp=2, cp=2)
    with pytest.raises(ValueError, match="tp=2 x cp=2 x pp=1 must divide world_size=6"):
        check_parallel_sizes(6, tp=2, cp=2)


def test_memory_plan_divides_tokens_by_cp():
    from rlhf.memory_plan.planner import _seq
    from tests.unit.memory_plan.test_memory_plan import small_input

    inp = small_input()  # seq 31, tp 2 with SP: padded to 32
    assert _seq(inp) == 32
    cp2 = dataclasses.replace(inp, layout=dataclasses.replace(inp.layout, cp=2))
    assert _seq(cp2) == 16  # padded to a multiple of 2*cp and tp*cp = 4: 32, half on each rank
    wide = dataclasses.replace(inp, layout=dataclasses.replace(inp.layout, cp=4))
    assert _seq(wide) == 8  # 31 -> 32 (a multiple of 8), a quarter each


def test_plan_from_config_reads_cp():
    from rlhf.memory_plan.from_config import plan_from_config
    from tests.unit.memory_plan.test_memory_plan import QWEN2_7B

    cfg = {"parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                        "context_parallel_size": 2},
           "data": {"max_prompt_length": 512, "max_response_length": 512, "train_batch_size": 64},
           "algorithm": {"name": "grpo", "adv_estimator": "grpo"},
           "rollout": {"n": 4, "num_engines": 4, "tensor_model_parallel_size": 2}, "model": {"dtype": "bfloat16"}}
    cp_plan = plan_from_config(cfg, QWEN2_7B, world_size=8)
    no_cp = plan_from_config({**cfg, "parallel": {**cfg["parallel"], "context_parallel_size": 1}}, QWEN2_7B,
                             world_size=8)
    fwd = "actor fwd/bwd"
    assert cp_plan.phase(fwd).torch_peak < no_cp.phase(fwd).torch_peak  # half the tokens' activations
    with pytest.raises(ValueError, match="tp=2 x cp=2 x pp=1 does not divide world_size=6"):
        plan_from_config(cfg, QWEN2_7B, world_size=6)


def test_config_batch_check_counts_cp():
    from rlhf.config import compose_config
    from rlhf.config.validate import config_problems

    cfg = compose_config(["recipe=quickstart", "parallel.tensor_model_parallel_size=2",
                          "parallel.context_parallel_size=2"])
    problems = config_problems(cfg, world_size=2)
    assert any("parallel.tensor_model_parallel_size=2 x parallel.context_parallel_size=2 x "
               "parallel.pipeline_model_parallel_size=1 = 4 does not divide the 2 trainer processes" in p
               for p in problems), problems
    assert not any("does not divide the 4 trainer" in p for p in config_problems(cfg, world_size=4))
