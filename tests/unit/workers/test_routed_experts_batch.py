"""The engines' routing in the batch (rlhf.workers.batch.routed_experts_batch) and SGLang's encoding of it
(rlhf.rollout.sglang_engine.decode_routed_experts): each token's experts land at that token's column of
``input_ids``, hand-checked on two samples of different prompt and response lengths."""
from __future__ import annotations

import numpy as np
import pybase64
import pytest
import torch

from rlhf.rollout.sglang_engine import decode_routed_experts
from rlhf.rollout.types import RolloutSample
from rlhf.workers.batch import build_rollout_batch


def _sample(prompt, response, L=2, k=2, base=0):
    n = len(prompt) + len(response) - 1  # SGLang: every token it ran, the last response token never fed back
    r = (base + np.arange(n * L * k, dtype=np.int32)).reshape(n, L, k) % 8
    return RolloutSample(prompt_ids=prompt, response_ids=response, response_log_probs=[0.0] * len(response),
                         finish_reason="stop", prompt_index=0, sample_index=0, extra={"routed_experts": r}), r


def test_routing_aligned_with_input_ids():
    s0, r0 = _sample([5, 6, 7], [8, 9], base=0)
    s1, r1 = _sample([5], [8, 9, 10], base=3)
    batch = build_rollout_batch([s0, s1], pad_token_id=0, max_response_length=4)
    re, mask = batch["routed_experts"], batch["routed_experts_mask"]
    assert re.shape == (2, 7, 2, 2) and re.dtype == torch.int16 and mask.shape == (2, 7)
    # row 0: prompt at columns 0..2, response 3..4; routing of tokens 5 6 7 8 -> columns 0..3
    assert torch.equal(re[0, 0:4], torch.as_tensor(r0, dtype=torch.int16))
    assert mask[0].tolist() == [True, True, True, True, False, False, False]
    # row 1: prompt at column 2 (left-padded), response 3..5; routing of 5 8 9 -> columns 2..4
    assert torch.equal(re[1, 2:5], torch.as_tensor(r1, dtype=torch.int16))
    assert mask[1].tolist() == [False, False, True, True, True, False, False]
    # elsewhere a valid filler routing: experts 0..k-1
    assert (re[1, :2] == torch.tensor([0, 1])).all() and (re[0, 4:] == torch.tensor([0, 1])).all()
    # the column of each routed token holds that token
    assert batch["input_ids"][0, 3].item() == 8 and batch["input_ids"][1, 2].item() == 5


def test_no_routing_no_keys():
    s = RolloutSample(prompt_ids=[5], response_ids=[6], response_log_probs=[0.0], finish_reason="stop",
                      prompt_index=0, sample_index=0)
    assert "routed_experts" not in build_rollout_batch([s], pad_token_id=0, max_response_length=2)


def test_decode_sglang_base64_int32():
    from rlhf.rollout.sglang_engine import EngineCallError

    a = np.arange(3 * 4 * 2, dtype=np.int32)
    out = decode_routed_experts(pybase64.b64encode(a.tobytes()).decode(), (4, 2))
    assert out.shape == (3, 4, 2) and out[2, 3, 1] == 23
    with pytest.raises(EngineCallError, match="not tokens x 5 layers x 2"):
        decode_routed_experts(pybase64.b64encode(a.tobytes()).decode(), (5, 2))


def test_decoded_routing_is_writable_so_torch_takes_it_without_a_warning():
    """SGLang's base64 routing decoded by np.frombuffer was read-only: torch.as_tensor warned on every R3 sample."""
    import warnings

    value = pybase64.b64encode(np.arange(12, dtype=np.int32).tobytes()).decode()
    arr = decode_routed_experts(value, (2, 2))
    assert arr.flags.writeable and arr.shape == (3, 2, 2) and arr[2, 1, 1] == 11
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.as_tensor(arr[:2]).sum().item() == sum(range(8))
