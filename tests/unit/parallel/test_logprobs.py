"""Vocab-parallel log-probs/entropy: values and gradients vs torch's log_softmax (single process;
the TP>1 path is covered by tests/e2e/test_foundation_dist.py)."""
import torch

from parallel.logprobs import vocab_parallel_log_probs


def reference(logits, labels, vocab_size, temperature):
    z = logits[..., :vocab_size] / temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_values_and_gradients_with_padded_vocab():
    torch.manual_seed(0)
    vocab, padded = 37, 64  # padded rows must be excluded
    logits = torch.randn(3, 5, padded, dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, vocab, (3, 5))
    w1, w2 = torch.randn(3, 5, dtype=torch.float32), torch.randn(3, 5, dtype=torch.float32)
    for temperature in (1.0, 0.6):
        lp, ent = vocab_parallel_log_probs(logits, labels, vocab_size=vocab, temperature=temperature,
                                           calculate_entropy=True)
        g = torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), logits)[0]
        ref_lp, ref_ent = reference(logits, labels, vocab, temperature)
        ref_g = torch.autograd.grad((ref_lp * w1).sum() + (ref_ent * w2).sum(), logits)[0]
        assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
        assert torch.isfinite(g).all()
        assert torch.allclose(g, ref_g, atol=1e-6)
        assert g[..., vocab:].abs().max() == 0  # no gradient reaches padded rows


def test_bad_temperature_and_shapes():
    import pytest

    with pytest.raises(ValueError, match="temperature=0"):
        vocab_parallel_log_probs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), vocab_size=4, temperature=0)
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_log_probs(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long), vocab_size=4)
