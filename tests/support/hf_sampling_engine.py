"""Test double of the rollout engines for trainer runs that test algorithms, not the engine: an in-process
Hugging Face model that receives the actor's weights through the REAL weight bridge (the engine handle
protocol of tests/fakes.FakeEngines: flattened buckets, checked names and shapes) and samples from them, so
rollouts stay on-policy, without Ray or an SGLang engine start (a minute or more on a shared CPU).

Sampling follows rlhf.rollout.SamplingConfig: ``n`` samples per prompt from the full softmax at
``temperature`` (greedy at 0; top-p / top-k are refused for training rollouts by the trainer and not
implemented here), generation stops after a stop token (kept as the last response token, finish reason
"stop") or at ``max_new_tokens`` ("length"); ``response_log_probs[t]`` = log_softmax(logits / temperature)
of the chosen token (raw log_softmax when greedy).  Deterministic for a given ``sampling.seed``.

Use: ``monkeypatch``/assign ``rlhf.workers.rollout.start_rollout = start_hf_sampling_engine`` before the
trainer is built (rollout.num_engines 1, rollout.mode colocated).
"""
from __future__ import annotations

import torch

from rlhf.rollout.types import FINISH_LENGTH, FINISH_STOP, RolloutSample
from tests.support.fakes import FakeEngines


class HFSamplingEngines(FakeEngines):
    """One in-memory engine (FakeEngines' handle protocol) that generates with an HF causal LM loaded from
    ``model_path`` and refreshed from the weights the bridge pushed before each ``generate``."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        expected = {k: (tuple(v.shape), v.dtype) for k, v in self.model.state_dict().items()}
        if self.model.config.tie_word_embeddings:  # the LM head is the embedding: the bridge sends it once
            expected.pop("lm_head.weight", None)
        super().__init__(expected, n=1, tp_size=1)
        self.num_restarts, self.released, self.loaded_updates = 0, set(), 0

    # ---- the manager's memory calls (nothing to free in process) ----
    def release_memory_occupation(self, tags=None):
        self.released = set(tags or ["kv_cache", "weights"])

    def resume_memory_occupation(self, tags=None):
        self.released -= set(tags or ["kv_cache", "weights"])

    def shutdown(self):
        self.log.append("shutdown")

    # ---- generation ----
    def _refresh_weights(self) -> None:
        received = self.engines[0].received
        updates = self._updates[0]
        if received and updates != self.loaded_updates:
            missing = set(self.expected) - set(received)
            assert not missing, f"the bridge did not push {sorted(missing)[:3]}"
            self.model.load_state_dict(received, strict=not self.model.config.tie_word_embeddings)
            self.loaded_updates = updates

    @torch.no_grad()
    def generate(self, prompts, sampling):
        assert not self.released, f"generate on engines that released {sorted(self.released)}"
        assert sampling.top_p == 1.0 and sampling.top_k in (-1, None), "top-p / top-k are not implemented"
        self._refresh_weights()
        stops = set(sampling.stop_token_ids)
        gen = torch.Generator().manual_seed(0 if sampling.seed is None else int(sampling.seed))
        out = []
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([list(prompt)] * sampling.n)
            done = torch.zeros(sampling.n, dtype=torch.bool)
            tokens, log_probs = [], []
            for _ in range(sampling.max_new_tokens):
                logits = self.model(input_ids=ids).logits[:, -1].float()
                if sampling.temperature > 0:
                    lp = torch.log_softmax(logits / sampling.temperature, dim=-1)
                    nxt = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(1)
                else:
                    lp = torch.log_softmax(logits, dim=-1)
                    nxt = lp.argmax(dim=-1)
                tokens.append(nxt)
                log_probs.append(lp.gather(1, nxt[:, None]).squeeze(1))
                ids = torch.cat([ids, nxt[:, None]], dim=1)
                done |= torch.tensor([int(t) in stops for t in nxt])
                if bool(done.all()):
                    break
            tokens_t, lps_t = torch.stack(tokens, 1), torch.stack(log_probs, 1)
            for j in range(sampling.n):
                row = tokens_t[j].tolist()
                end = next((k + 1 for k, t in enumerate(row) if t in stops), None)
                reason = FINISH_STOP if end is not None else FINISH_LENGTH
                end = end or len(row)
                out.append(RolloutSample(list(prompt), row[:end], lps_t[j, :end].tolist(), reason, i, j,
                                         weight_version=self.loaded_updates))
        return out


def start_hf_sampling_engine(cfg, model_path: str) -> HFSamplingEngines:
    """Drop-in for rlhf.workers.rollout.start_rollout (one engine, colocated)."""
    assert cfg.rollout.num_engines == 1 and cfg.rollout.mode == "colocated", "one colocated engine only"
    return HFSamplingEngines(model_path)
