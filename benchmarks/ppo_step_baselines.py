"""The plain transformers/torch baselines of benchmarks/ppo_step.py: what a user would write instead of the
trainer for each phase, on the same model, batches and lengths (see ppo_step.py's docstring)."""
import time

import torch


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def hf_generate(model, samples, max_new_tokens, stop_ids, pad_id):
    """Greedy `generate` of the samples' prompts (one row per sample, left-padded); returns the response
    token lists, each cut after its first stop token (the engine keeps the stop token too)."""
    prompts = [list(s.prompt_ids) for s in samples]
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=list(stop_ids), pad_token_id=pad_id)
    responses = []
    for row in out[:, L:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stop_ids), len(row))
        responses.append(row[:cut])
    return responses


def hf_log_probs(model, batch, micro):
    """No-grad log p(response tokens) [N, R] with a plain HF forward in micro batches of `micro` rows."""
    P, resp = batch["prompt_length"], batch["responses"]
    out = []
    with torch.no_grad():
        for i in range(0, resp.shape[0], micro):
            sl = slice(i, i + micro)
            logits = model(input_ids=batch["input_ids"][sl], attention_mask=batch["attention_mask"][sl],
                           position_ids=batch["position_ids"][sl]).logits
            lp = torch.log_softmax(logits[:, P - 1:-1].float(), -1)
            out.append(lp.gather(-1, resp[sl].unsqueeze(-1)).squeeze(-1))
    return torch.cat(out) * batch["response_mask"]


def hf_update(model, opt, batch, rows_per_mini, micro, acfg, clip_grad):
    """One pass of the PPO update: per mini batch of `rows_per_mini` rows, gradients accumulated over micro
    batches of `micro` rows (forward, clipped PPO loss with dual clip, token-mean, backward), then
    clip_grad_norm_ and one optimizer step.  Returns the mean entropy (computed without grad: the metric the
    trainer logs)."""
    P, N = batch["prompt_length"], batch["responses"].shape[0]
    c, c3 = acfg.clip_ratio, acfg.clip_ratio_c
    entropies = []
    for m0 in range(0, N, rows_per_mini):
        opt.zero_grad(set_to_none=True)
        n_micro = max(1, min(rows_per_mini, N - m0) // micro)
        for i in range(m0, min(m0 + rows_per_mini, N), micro):
            sl = slice(i, i + micro)
            logits = model(input_ids=batch["input_ids"][sl], attention_mask=batch["attention_mask"][sl],
                           position_ids=batch["position_ids"][sl]).logits
            logp = torch.log_softmax(logits[:, P - 1:-1].float(), -1)
            lp = logp.gather(-1, batch["responses"][sl].unsqueeze(-1)).squeeze(-1)
            with torch.no_grad():
                entropies.append(-(logp.exp() * logp).sum(-1).mean())  # the actor/entropy metric
            adv, mask = batch["advantages"][sl], batch["response_mask"][sl].float()
            ratio = torch.exp(lp - batch["old_log_probs"][sl])
            pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - c, 1 + c))
            pg = torch.where(adv < 0, torch.minimum(pg, -adv * c3), pg)
            loss = (pg * mask).sum() / mask.sum().clamp(min=1) / n_micro
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        opt.step()
    return float(torch.stack(entropies).mean())


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def copy_seconds(nbytes, repeats=5):
    """Median seconds of `dst.copy_(src)` of `nbytes` bytes with one thread (after one untimed copy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = median([timed(dst.copy_, src)[0] for _ in range(repeats)])
    torch.set_num_threads(threads)
    return t


class HFBaselines:
    """The HF model (from the same checkpoint as the trainer), its AdamW, and one call per trainer step that
    times generate / log-probs / update on that step's prompts and batch (in that order, so step 1 sees
    the initial weights on both sides).  Runs with `threads` torch threads; restores the count after."""

    def __init__(self, model_dir, cfg, response_length, stop_ids, pad_id, threads):
        from transformers import AutoModelForCausalLM

        self.cfg, self.R, self.stop_ids, self.pad_id, self.threads = cfg, response_length, stop_ids, pad_id, threads
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        o = cfg.actor.optim
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                     eps=o.adam_eps, weight_decay=o.weight_decay)
        self.update_args = (cfg.actor.ppo_mini_batch_size * cfg.rollout.n, cfg.actor.ppo_micro_batch_size_per_gpu,
                            cfg.actor, o.clip_grad)

    def step(self, rec, probe_log=None):
        """Times {"gen", "logprob", "update"} (seconds) on the Recorder's step record `rec`; with `probe_log`,
        also log the correctness probes (greedy tokens and old log-probs against the trainer's)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            t = {}
            t["gen"], resp = timed(hf_generate, self.model, rec["samples"], self.R, self.stop_ids, self.pad_id)
            t["logprob"], lp = timed(hf_log_probs, self.model, rec["batch"], self.cfg.actor.log_prob_micro_batch_size_per_gpu)
            t["update"], _ = timed(hf_update, self.model, self.opt, rec["batch"], *self.update_args)
        finally:
            torch.set_num_threads(threads)
        eng = [list(x.response_ids) for x in rec["samples"]]
        t["tokens_equal"] = sum(map(len, eng)) == sum(map(len, resp))
        if probe_log is not None:
            same = sum(x == y for x, y in zip(resp, eng))
            prefix = [next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                      for x, y in zip(resp, eng)]
            ref = rec["batch"]["old_log_probs"] * rec["batch"]["response_mask"]
            probe_log(f"probe (initial weights): {same}/{len(eng)} greedy responses identical to HF generate (mean common "
                      f"prefix {sum(prefix) / len(prefix):.1f} of {self.R} tokens); old log-probs max |trainer - HF| = "
                      f"{(lp - ref).abs().max().item():.2e}")
        return t
