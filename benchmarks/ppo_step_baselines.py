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
    clip_grad_norm_ and one optimizer step.  Entropy is computed (no grad) as the metric the trainer logs."""
    P, N = batch["prompt_length"], batch["responses"].shape[0]
    c, c3 = acfg.clip_ratio, acfg.clip_ratio_c
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
                entropy = -(logp.exp() * logp).sum(-1)  # noqa: F841  (the actor/entropy metric)
            adv, mask = batch["advantages"][sl], batch["response_mask"][sl].float()
            ratio = torch.exp(lp - batch["old_log_probs"][sl])
            pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - c, 1 + c))
            pg = torch.where(adv < 0, torch.minimum(pg, -adv * c3), pg)
            loss = (pg * mask).sum() / mask.sum().clamp(min=1) / n_micro
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        opt.step()


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def run_baselines(model_dir, cfg, steps, a, nbytes, stop_ids, pad_id, log):
    """All baselines on rank 0; `steps` are the Recorder's per-step records (samples, batch).  Returns the
    median seconds {"gen", "logprob", "update", "copy"}."""
    from transformers import AutoModelForCausalLM

    res = {}
    torch.set_num_threads(1)
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    res["copy"] = median([timed(dst.copy_, src)[0] for _ in range(5)])
    del src, dst
    log(f"plain copy of {nbytes / 1e6:.1f} MB (1 thread): {res['copy'] * 1e3:.1f} ms "
        f"-> {nbytes / res['copy'] / 1e9:.2f} GB/s")

    torch.set_num_threads(a.hf_threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    R, probe, timed_steps = a.response_length, steps[0], steps[a.warmup:]
    # generation: probe on step 1 (initial weights on both sides), then the timed steps' prompts
    hf_resp = hf_generate(model, probe["samples"], R, stop_ids, pad_id)
    eng_resp = [list(s.response_ids) for s in probe["samples"]]
    same = sum(x == y for x, y in zip(hf_resp, eng_resp))
    prefix = [next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
              for x, y in zip(hf_resp, eng_resp)]
    log(f"greedy tokens, step 1 (initial weights): {same}/{len(eng_resp)} responses identical to HF generate, "
        f"mean common prefix {sum(prefix) / len(prefix):.1f} of {R} tokens")
    times = []
    for s in timed_steps:
        t, resp = timed(hf_generate, model, s["samples"], R, stop_ids, pad_id)
        times.append(t)
        n_eng, n_hf = sum(len(x.response_ids) for x in s["samples"]), sum(len(x) for x in resp)
        if n_eng != n_hf:
            log(f"note: engine generated {n_eng} tokens, HF {n_hf} (EOS reached): timing not like for like")
    res["gen"] = median(times)
    log(f"HF generate ({len(probe['samples'])} sequences x {R} new tokens, greedy, {a.hf_threads} threads): "
        f"median {res['gen']:.3f} s of {[round(t, 3) for t in times]}")

    micro_lp = cfg.actor.log_prob_micro_batch_size_per_gpu
    lp = hf_log_probs(model, probe["batch"], micro_lp)
    ref = probe["batch"]["old_log_probs"] * probe["batch"]["response_mask"]
    log(f"old log-probs, step 1: max |trainer - HF| = {(lp - ref).abs().max().item():.2e}")
    times = [timed(hf_log_probs, model, s["batch"], micro_lp)[0] for s in timed_steps]
    res["logprob"] = median(times)
    log(f"HF forward log-probs (micro batch {micro_lp}): median {res['logprob']:.3f} s of {[round(t, 3) for t in times]}")

    o = cfg.actor.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay)
    rows = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    micro = cfg.actor.ppo_micro_batch_size_per_gpu
    args = (rows, micro, cfg.actor, o.clip_grad)
    hf_update(model, opt, probe["batch"], *args)  # warm-up: AdamW state allocation, first-touch pages
    times = [timed(hf_update, model, opt, s["batch"], *args)[0] for s in timed_steps]
    res["update"] = median(times)
    log(f"HF forward+backward+AdamW (mini batch {rows} rows, micro {micro}): median {res['update']:.3f} s of "
        f"{[round(t, 3) for t in times]}")
    return res
