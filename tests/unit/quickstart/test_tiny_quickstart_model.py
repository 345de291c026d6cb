"""``tiny://quickstart``: the locally built, warmed-up tiny Llama (rlhf/quickstart/).

Fast tests build with a handful of warm-up steps; the slow one builds the default model
(~15-30 s on 2 cores) and checks it lands in the tuned band:

* greedy accuracy on 50 held-out problems in [0.6, 1.0] (measured on 100: 0.76 / 0.86 / 0.98
  for seeds 0 / 1 / 2);
* sampled (T=1) reward in [0.2, 0.5] (measured 0.35 / 0.31 / 0.36), answer format >= 0.9,
  EOS >= 0.95.

("Held-out" = rows drawn with another seed; with max_operand=9 the task has only 81
distinct sums, so the problems themselves overlap the warm-up data by design.)
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rlhf.quickstart import tiny
from rlhf.quickstart.arithmetic import make_arithmetic_dataset, quickstart_task_kwargs, write_arithmetic_parquet
from rlhf.quickstart.evaluate import evaluate_model
from rlhf.quickstart.model import META_FILE, QUICKSTART_DEFAULTS, build_quickstart_model, resolve_model_path
from rlhf.quickstart.sft import corrupt_answers, response_loss
from rlhf.quickstart.tokenizer import encode_example, prompt_ids
from rlhf.rewards.gsm8k import compute_score

FEW = dict(warmup_steps=60, batch_size=16)


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return build_quickstart_model(tmp_path_factory.mktemp("qs") / "model", **FEW)


def test_build_loads_with_auto_classes_and_tokenizer_round_trips(small_model):
    model, tok = _load(small_model)
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id == 2
    assert tok.pad_token_id == model.config.pad_token_id == 0
    gen = json.load(open(os.path.join(small_model, "generation_config.json")))
    assert gen["eos_token_id"] == [2] and gen["pad_token_id"] == 0
    assert "top_k" not in gen and "temperature" not in gen  # sampling comes from the rollout config
    text = "3+4=7\n#### 7"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert [tok.decode([i]) for i in tok("1234", add_special_tokens=False)["input_ids"]] == list("1234")
    rendered = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    meta = json.load(open(os.path.join(small_model, META_FILE)))
    assert meta["warmup_steps"] == FEW["warmup_steps"] and meta["task"] == {
        "style": "short", "ops": ["+"], "min_operand": 1, "max_operand": 9}


def test_prompts_encoded_like_rl_dataset(small_model, tmp_path):
    from rlhf.data.rl_dataset import RLHFDataset

    _, tok = _load(small_model)
    paths = write_arithmetic_parquet(tmp_path, n_train=8, n_test=2, seed=3, **quickstart_task_kwargs())
    ds = RLHFDataset(paths["train"], tok, max_prompt_length=64)
    assert len(ds) == 8  # every quickstart prompt fits the default max_prompt_length
    rows = make_arithmetic_dataset(8, seed=3, split="train", **quickstart_task_kwargs())
    for i, r in enumerate(rows):
        assert ds[i]["input_ids"] == prompt_ids(tok, r["prompt"])
        p, resp = encode_example(tok, r["prompt"], r["solution"])
        assert resp[-1] == tok.eos_token_id and len(resp) <= 12  # fits max_response_length 16
        assert tok.decode(resp, skip_special_tokens=True) == r["solution"]


def test_cache_reuse_and_rebuild_on_changed_args(small_model, monkeypatch):
    from rlhf.quickstart import model as quickstart_model

    weights = os.path.join(small_model, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns
    monkeypatch.setattr(quickstart_model, "_build", lambda *a, **k: pytest.fail("cache not reused"))
    assert build_quickstart_model(small_model, **FEW) == str(small_model)
    assert os.stat(weights).st_mtime_ns == mtime
    monkeypatch.undo()
    calls = []
    monkeypatch.setattr(quickstart_model, "_build", lambda *a, **k: calls.append(k))
    build_quickstart_model(small_model, warmup_steps=FEW["warmup_steps"] + 1, batch_size=FEW["batch_size"])
    assert len(calls) == 1  # any changed argument invalidates the cache


def test_built_model_is_found_without_building(small_model):
    from rlhf.quickstart.model import built_quickstart_model

    cache = Path(small_model).parent
    renamed = cache / "tiny_quickstart_model"  # the name resolve_model_path builds under cache_dir
    if not renamed.exists():
        renamed.symlink_to(small_model)
    # the engines are launched from this path before the trainer resolves (and would reuse) the model
    assert built_quickstart_model(cache, **FEW) == str(renamed)
    assert built_quickstart_model(cache, **{**FEW, "warmup_steps": FEW["warmup_steps"] + 1}) is None  # a rebuild
    assert built_quickstart_model(cache / "elsewhere", **FEW) is None


def test_resolve_model_path(tmp_path, monkeypatch):
    from rlhf.quickstart import model as quickstart_model

    seen = []
    monkeypatch.setattr(quickstart_model, "build_quickstart_model",
                        lambda out, **kw: seen.append((out, kw)) or str(out))
    assert resolve_model_path("/some/hf/dir", tmp_path) == "/some/hf/dir"
    assert resolve_model_path("Qwen/Qwen2.5-0.5B", tmp_path) == "Qwen/Qwen2.5-0.5B"
    out = resolve_model_path("tiny://quickstart", tmp_path, warmup_steps=7, warmup_lr=None)
    assert out == str(tmp_path / "tiny_quickstart_model") and seen[-1][1] == {"warmup_steps": 7}
    with pytest.raises(ValueError, match="tiny://quickstart"):
        resolve_model_path("tiny://other", tmp_path)


def test_deterministic_and_rng_untouched(tmp_path):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = build_quickstart_model(tmp_path / "a", warmup_steps=5, batch_size=8)
    assert torch.equal(torch.get_rng_state(), state)
    b = build_quickstart_model(tmp_path / "b", warmup_steps=5, batch_size=8)
    from safetensors.torch import load_file

    sa, sb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_warmup_reduces_response_loss_by_a_wide_margin(small_model, tmp_path):
    untrained = build_quickstart_model(tmp_path / "untrained", warmup_steps=0)
    rows = make_arithmetic_dataset(32, seed=12345, **quickstart_task_kwargs())
    losses = []
    for path in (untrained, small_model):
        model, tok = _load(path)
        with torch.no_grad():
            ex = [encode_example(tok, r["prompt"], r["solution"]) for r in rows]
            losses.append(response_loss(model.eval(), ex, tok.pad_token_id).item())
    assert losses[0] > 5.0 and losses[1] < 0.35 * losses[0], losses


def test_corrupt_answers_only_touches_the_final_line():
    rows = make_arithmetic_dataset(400, seed=0, **quickstart_task_kwargs())
    bad = corrupt_answers(rows, 0.6, seed=1)
    n_wrong = 0
    for r, c in zip(rows, bad):
        body, final = c["solution"].rsplit("#### ", 1)
        assert body == r["solution"].rsplit("#### ", 1)[0]  # the worked line stays correct
        assert 0 <= int(final) and abs(int(final) - int(r["ground_truth"])) <= 2
        n_wrong += compute_score(c["solution"], r["ground_truth"]) == 0.0
    assert 0.5 < n_wrong / len(rows) < 0.7
    assert corrupt_answers(rows, 0.0) == rows


def test_test_helpers_reexport_the_product_code():
    from tests.support import tiny_models, tiny_tokenizer

    assert tiny_models.make_tiny_hf_model is tiny.make_tiny_hf_model
    assert tiny_models.TINY_CONFIGS is tiny.TINY_CONFIGS
    assert tiny_tokenizer.make_tiny_tokenizer is tiny.make_tiny_tokenizer
    assert tiny_tokenizer.save_tiny_tokenizer is tiny.save_tiny_tokenizer
    assert tiny_tokenizer.CHAT_TEMPLATE == tiny.CHAT_TEMPLATE


@pytest.mark.slow
def test_default_model_is_in_the_tuned_band(tmp_path):
    path = build_quickstart_model(tmp_path / "default")
    stats = json.load(open(os.path.join(path, "warmup_stats.json")))
    assert stats["final_loss"] < 0.3 * stats["first_loss"]
    model, tok = _load(path)
    rows = make_arithmetic_dataset(50, seed=QUICKSTART_DEFAULTS["seed"] + 424242, split="test",
                                   **quickstart_task_kwargs())
    greedy = evaluate_model(model, tok, rows)
    sampled = evaluate_model(model, tok, rows, temperature=1.0, num_samples=4, seed=0)
    assert 0.6 <= greedy["reward"] <= 1.0, greedy
    assert 0.2 <= sampled["reward"] <= 0.5, sampled
    assert sampled["format"] >= 0.9 and sampled["eos"] >= 0.95, sampled


# --------------------------------------------------------------------------- the hook (rlhf/quickstart/resolve.py)


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _hook_cfg(tmp_path, algorithm="ppo", train="embedded://arithmetic", val="embedded://arithmetic", model="x"):
    from types import SimpleNamespace as NS

    return NS(data=NS(train_files=train, val_files=val, embedded_num_train=6, embedded_num_val=3,
                      embedded_max_operand=5, seed=11),
              trainer=NS(default_local_dir=str(tmp_path / "run")), algorithm=NS(name=algorithm),
              model=NS(path=model, warmup_steps=7, warmup_lr=None))


def test_resolve_data_writes_the_embedded_tasks(tmp_path, one_rank):
    from rlhf.data.files import read_rows
    from rlhf.quickstart.arithmetic import make_synthetic_preference_dataset
    from rlhf.quickstart.resolve import resolve_data

    cfg = _hook_cfg(tmp_path)
    train, val = resolve_data(cfg, "train"), resolve_data(cfg, "val")
    assert train == str(tmp_path / "run" / "data" / "train.parquet") and val.endswith("test.parquet")
    expect = make_arithmetic_dataset(6, seed=11, split="train", **quickstart_task_kwargs(5))
    assert [(r["prompt"], r["ground_truth"]) for r in read_rows(train)] == [
        (r["prompt"], r["ground_truth"]) for r in expect]
    assert len(read_rows(val)) == 3
    # DPO: preference pairs (embedded://arithmetic means the same), the validation split seeded + 1
    cfg = _hook_cfg(tmp_path, "dpo", train="embedded://preference")
    rows = read_rows(resolve_data(cfg, "val"))
    expect = make_synthetic_preference_dataset(3, seed=12, **quickstart_task_kwargs(5))
    assert [(r["chosen"], r["rejected"]) for r in rows] == [(r["chosen"], r["rejected"]) for r in expect]
    assert len(read_rows(resolve_data(cfg, "train"))) == 6
    # anything else is returned as it is; unknown tasks name the valid ones
    assert resolve_data(_hook_cfg(tmp_path, train=["a.jsonl"]), "train") == ["a.jsonl"]
    with pytest.raises(ValueError, match="'embedded://arithmetic'"):
        resolve_data(_hook_cfg(tmp_path, train="embedded://preference"), "train")
    with pytest.raises(ValueError, match="embedded://preference"):
        resolve_data(_hook_cfg(tmp_path, "dpo", val="embedded://poems"), "val")


def test_resolve_model_builds_tiny_only(tmp_path, one_rank, monkeypatch):
    from rlhf.quickstart import model as quickstart_model
    from rlhf.quickstart.resolve import resolve_model

    seen = []
    monkeypatch.setattr(quickstart_model, "build_quickstart_model",
                        lambda out, **kw: seen.append((out, kw)) or str(out))
    assert resolve_model(_hook_cfg(tmp_path, model="/models/hf")) == "/models/hf" and not seen
    out = resolve_model(_hook_cfg(tmp_path, model="tiny://quickstart"))
    assert out == str(tmp_path / "run" / "tiny_model" / "tiny_quickstart_model")
    assert seen[-1][1] == {"warmup_steps": 7, "max_operand": 5}  # None (warmup_lr) means the default


def test_quickstart_init_is_the_model_before_its_warmup(tmp_path, monkeypatch):
    """tiny://quickstart-init (the on-policy distillation recipe's student): the quickstart build with 0 warm-up
    steps, in a directory of its own, so resolving it never replaces the warmed-up tiny://quickstart (the teacher)."""
    from rlhf.data.refs import parse_model_ref
    from rlhf.quickstart import model as quickstart_model
    from rlhf.quickstart.model import built_quickstart_model

    assert parse_model_ref("tiny://quickstart-init").exists and not parse_model_ref("tiny://quickstart-x").exists
    seen = []
    monkeypatch.setattr(quickstart_model, "build_quickstart_model",
                        lambda out, **kw: seen.append((out, kw)) or str(out))
    assert resolve_model_path("tiny://quickstart-init", tmp_path, warmup_steps=300) == str(
        tmp_path / "tiny_quickstart_init") and seen[-1][1] == {"warmup_steps": 0}
    assert resolve_model_path("tiny://quickstart", tmp_path, warmup_steps=300) == str(
        tmp_path / "tiny_quickstart_model") and seen[-1][1] == {"warmup_steps": 300}
    monkeypatch.undo()
    out = resolve_model_path("tiny://quickstart-init", tmp_path, max_operand=5)
    meta = json.loads((Path(out) / META_FILE).read_text())
    assert meta["warmup_steps"] == 0 and meta["seed"] == QUICKSTART_DEFAULTS["seed"]
    assert built_quickstart_model(tmp_path, init=True, max_operand=5) == out
    assert built_quickstart_model(tmp_path, max_operand=5) is None  # the warmed-up one is not there
    # the initial weights: the same seed's HF init as the warm-up starts from
    model, tok = _load(out)
    init = tiny.build_tiny_hf_model("llama_gqa", vocab_size=len(tok), hidden_size=QUICKSTART_DEFAULTS["hidden_size"],
                                    num_layers=QUICKSTART_DEFAULTS["num_layers"], seed=QUICKSTART_DEFAULTS["seed"],
                                    init="hf", dtype=torch.float32, bos_token_id=tiny.IM_START_ID,
                                    eos_token_id=tiny.IM_END_ID, pad_token_id=tiny.PAD_ID,
                                    max_position_embeddings=model.config.max_position_embeddings)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), init.state_dict().values()))
