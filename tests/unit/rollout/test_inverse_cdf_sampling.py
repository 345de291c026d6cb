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


def test_two_level_search_picks_the_one_level_token():
    """Large vocabularies search blocks, then tokens: for the same uniforms the same tokens as one float64 cumulative
    sum over the row (shapes with and without a shorter last block)."""
    torch.manual_seed(2)
    for v_size in (4 * icdf.BLOCK, 5000, 32000):
        probs = torch.softmax(torch.randn(512, v_size) * 3, -1)
        u = torch.rand(512, 1, dtype=torch.float64)
        same = (icdf.search_two_level(probs, u) == icdf.search(probs, u)).double().mean().item()
        assert same >= 0.99, (v_size, same)
    assert icdf.inverse_cdf_sample(torch.softmax(torch.randn(3, 32000), -1)).shape == (3,)


def test_two_level_frequencies_at_block_edges_and_empty_blocks():
    """Mass on both sides of block edges, in the short last block, whole blocks of zeros between: frequencies
    within 5 binomial standard deviations, zero-probability tokens (and empty blocks) never drawn."""
    torch.manual_seed(3)
    v_size, block = 5000, icdf.BLOCK
    p = torch.zeros(v_size)
    where = [0, block - 1, block, 2 * block - 1, 4 * block + 3, v_size - 1]
    p[where] = torch.tensor([0.3, 0.1, 0.15, 0.05, 0.25, 0.15])
    draws = 100_000
    tokens = icdf.search_two_level(p.expand(draws, -1).contiguous(),
                                   torch.rand(draws, 1, dtype=torch.float64)).long()
    freq = torch.bincount(tokens, minlength=v_size).double() / draws
    sd = (p.double() * (1 - p.double()) / draws).sqrt()
    assert (freq - p.double()).abs().le(5 * sd + 1e-12).all()
    assert freq[p == 0].sum() == 0
