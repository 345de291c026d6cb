"""The CPU engine's inverse-CDF sampler (rlhf/rollout/sglang_cpu/standin/sgl_kernel/_inverse_cdf_sampling.py):
the token frequencies match the probabilities (against the exact values, with a bound derived from the binomial
standard deviation), zero-probability tokens are never drawn, unnormalised rows work, and a request with a
per-request seed keeps SGLang's own seeded sampler."""
import types

import torch

from tests.support.cpu_standin import load_standin_module


icdf = load_standin_module("_inverse_cdf_sampling")


def test_frequencies_match_the_probabilities():
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.0, 0.2, 0.05, 0.0, 0.25])
    draws = 200_000
    tokens = icdf.inverse_cdf_sample(p.expand(draws, -1).contiguous())
    assert tokens.dtype == torch.int32 and tokens.shape == (draws,)
    freq = torch.bincount(tokens.long(), minlength=6).double() / draws
    sd = (p.double() * (1 - p.double()) / draws).sqrt()
    assert (freq - p.double()).abs().le(5 * sd + 1e-12).all(), (freq, p)
    assert freq[1] == 0 and freq[4] == 0


def test_rows_are_independent_and_need_not_be_normalised():
    torch.manual_seed(1)
    rows = torch.tensor([[0.0, 0.0, 3.0], [2.0, 0.0, 0.0], [0.0, 1e-30, 0.0]])
    assert icdf.inverse_cdf_sample(rows).tolist() == [2, 0, 1]
    # probability underflowing to 0 at both ends of a 32k vocabulary (softmax of extreme logits)
    logits = torch.full((4, 32000), -1e4)
    logits[:, 17] = 0.0
    logits[:, 31000] = 0.0
    drawn = set(icdf.inverse_cdf_sample(torch.softmax(logits, -1)).tolist())
    assert drawn <= {17, 31000}


def test_patch_keeps_the_seeded_path():
    calls = []

    def original(probs, sampling_seed=None, positions=None):
        calls.append(sampling_seed)
        return torch.zeros(probs.shape[0], dtype=torch.int32)

    module = types.SimpleNamespace(sampling_from_probs_torch=original)
    icdf.patch(module)
    icdf.patch(module)  # idempotent
    probs = torch.tensor([[0.0, 1.0]])
    assert module.sampling_from_probs_torch(probs).tolist() == [1] and calls == []
    seed = torch.tensor([7])
    assert module.sampling_from_probs_torch(probs, sampling_seed=seed, positions=torch.tensor([0])).tolist() == [0]
    assert calls == [seed]
