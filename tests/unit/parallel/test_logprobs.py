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


def test_no_grad_slices_give_the_same_values(monkeypatch):
    """Without autograd, large logits are processed in slices of the leading dim (bounded temporaries): the same
    log-probs and entropies, bitwise, as in one piece (with autograd, one piece), with a padded vocab and a
    temperature, and a leading dim that the slice size does not divide."""
    import parallel.logprobs as lp_mod

    torch.manual_seed(1)
    vocab, padded = 37, 64
    logits = torch.randn(7, 5, padded)
    labels = torch.randint(0, vocab, (7, 5))
    with torch.no_grad():
        whole = vocab_parallel_log_probs(logits, labels, vocab_size=vocab, temperature=0.7, calculate_entropy=True)
        monkeypatch.setattr(lp_mod, "NO_GRAD_CHUNK_ELEMENTS", 2 * 5 * padded)  # slices of 2 rows: 4 slices
        calls = []
        real = lp_mod._log_probs
        monkeypatch.setattr(lp_mod, "_log_probs", lambda lg, lb, **kw: calls.append(lg.shape[0]) or real(lg, lb, **kw))
        sliced = vocab_parallel_log_probs(logits, labels, vocab_size=vocab, temperature=0.7, calculate_entropy=True)
    assert calls == [2, 2, 2, 1]
    assert torch.equal(sliced[0], whole[0]) and torch.equal(sliced[1], whole[1])
    calls.clear()
    lp, _ = vocab_parallel_log_probs(logits.requires_grad_(), labels, vocab_size=vocab)
    assert calls == [7] and lp.requires_grad
