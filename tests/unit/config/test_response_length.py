"""data.max_response_length against the run, at ``--cfg`` (rlhf/config/validate.py, rlhf/data/length_check.py):

* prompt + response within the model's context for every model whose config.json can be read without the network
  (a local directory, a hub model in the HF cache, tiny://quickstart), as SGLang derives that context, and the
  rollout engine asks for no more (it refuses to start with a longer context than the model's);
* the settings sized in response tokens (dynamic-batching token budgets, DAPO's overlong buffer), refused at
  ``--cfg`` instead of on the trainer's ranks;
* a warning when the data's reference solutions (GSM8K's worked answers) mostly do not fit the response limit.
"""
from __future__ import annotations

import json
import logging

import pytest

from rlhf.config import ConfigValidationError, compose_config, validate_config
from rlhf.config.validate import config_problems
from rlhf.preflight import model_context_length


def _model(path, **hf):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                  "hidden_size": 64, "num_attention_heads": 4,
                                                  "num_key_value_heads": 2, "num_hidden_layers": 2,
                                                  "intermediate_size": 128, "vocab_size": 400, **hf}))
    return path


def _context_problems(overrides):
    return [p for p in config_problems(compose_config(overrides), world_size=1) if "exceeds the model's context" in p]


def test_prompt_plus_response_within_the_model_context_and_the_engine_asks_no_more(tmp_path, monkeypatch):
    """p + r = max_position_embeddings passes and the engine is started with exactly that (SGLang refuses a
    context longer than the model's: the previous p + r + 8 failed at engine start after --cfg passed);
    p + r one more is refused at --cfg naming the response length that fits."""
    from rlhf.rollout.engine_args import rollout_context_length

    assert _context_problems(["data.max_prompt_length=1000", "data.max_response_length=31768"]) == []
    assert rollout_context_length(1000, 31768) == 32768  # tiny://quickstart's max_position_embeddings
    [p] = _context_problems(["data.max_prompt_length=1000", "data.max_response_length=31769"])
    assert p == ("data.max_prompt_length=1000 + data.max_response_length=31769 = 32769 exceeds the model's context "
                 "max_position_embeddings=32768 (tiny://quickstart): the rollout engine refuses a longer context at "
                 "start-up; set data.max_response_length=31768 (or lower data.max_prompt_length).")
    local = _model(tmp_path / "local", max_position_embeddings=1024)  # a local model directory
    at = [f"model.path={local}", "data.max_prompt_length=1000"]
    assert _context_problems([*at, "data.max_response_length=24"]) == []
    [p] = _context_problems([*at, "data.max_response_length=25"])
    assert f"max_position_embeddings=1024 ({local / 'config.json'})" in p and "data.max_response_length=24 (" in p
    # a hub model already in the HF cache (no network), with YaRN scaling: SGLang serves factor x the positions
    import huggingface_hub.constants as hc

    snap = _model(tmp_path / "models--acme--tiny" / "snapshots" / "abc", max_position_embeddings=512,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0})
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    hub = ["model.path=acme/tiny", "data.max_prompt_length=1024"]
    assert _context_problems([*hub, "data.max_response_length=1024"]) == []
    [p] = _context_problems([*hub, "data.max_response_length=1025"])
    assert f"max_position_embeddings=2048 ({snap / 'config.json'})" in p and "data.max_response_length=1024" in p
    assert _context_problems(["model.path=acme/not-downloaded", "data.max_response_length=100000"]) == []


def test_model_context_length_follows_sglang():
    """sglang/srt/utils/hf_transformers/common.py get_context_length: the first of its keys, times the RoPE
    factor unless the scaling names original_max_position_embeddings or is llama3's; a VLM's text config."""
    assert model_context_length({"max_position_embeddings": 4096}) == (4096, "max_position_embeddings")
    assert model_context_length({"seq_length": 2048, "max_position_embeddings": 4096}) == (2048, "seq_length")
    linear = {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert model_context_length(linear) == (8192, "max_position_embeddings")
    assert model_context_length({"max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0}}) == (131072, "max_position_embeddings")
    assert model_context_length({"max_position_embeddings": 32768, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})[0] == 32768
    assert model_context_length({"text_config": {"max_position_embeddings": 128000}})[0] == 128000
    assert model_context_length({"hidden_size": 8}) is None


def test_response_sized_settings_refused_at_cfg():
    """verl's dynamic-batching budgets (set from the lengths in its scripts) and DAPO's overlong buffer, in verl's
    keys: refused by the config checks (--cfg), not after the launch on the trainer's ranks."""
    with pytest.raises(ConfigValidationError) as e:
        validate_config(compose_config(["data.max_prompt_length=64", "data.max_response_length=32",
                        "actor_rollout_ref.actor.use_dynamic_bsz=True",
                        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=95",
                        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=64",
                        "reward_model.reward_manager=dapo",
                        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=33"]), world_size=1)
    assert e.value.problems == [
        "actor.ppo_max_token_len_per_gpu=95 is below data.max_prompt_length + data.max_response_length = 96: a "
        "sequence could fit in no micro batch; set actor.ppo_max_token_len_per_gpu >= 96 (verl users typically use "
        "2-3x that), or turn dynamic batching off.",
        "actor.log_prob_max_token_len_per_gpu=64 is below data.max_prompt_length + data.max_response_length = 96: a "
        "sequence could fit in no micro batch; set actor.log_prob_max_token_len_per_gpu >= 96 (verl users typically "
        "use 2-3x that), or turn dynamic batching off.",
        "reward.overlong_buffer.len=33 must be in (0, data.max_response_length=32]: the buffer is the last tokens "
        "before the response limit; set reward.overlong_buffer.len<=32 (verl's DAPO scripts use a quarter to a half "
        "of it), or null for a quarter."]
    validate_config(compose_config(["data.max_prompt_length=64", "data.max_response_length=32",
                                    "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=96",
                                    "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=32"]),
                    world_size=1)


GSM8K_ROWS = [("Tom has 3 apples and buys 4 more. How many apples?", "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"),
              ("Ann has 9 pens and gives 2 away. How many are left?",
               "Ann gives 2 of her 9 pens away, so she keeps 9 - 2 = <<9-2=7>>7 pens in the end.\n#### 7"),
              ("Sam has 2 boxes of 5 cups. How many cups does Sam have?",
               "Each of the 2 boxes holds 5 cups, and 2 x 5 = <<2*5=10>>10, so Sam has 10 cups in all, which is "
               "the answer.\n#### 10")]


@pytest.fixture()
def data(tmp_path, monkeypatch):
    """The rows above as raw GSM8K jsonl (question / answer) and as verl's GSM8K parquet (the worked answer in
    extra_info.answer), and as verl's MATH parquet (a bare ground truth: nothing to compare with)."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raw = tmp_path / "gsm8k.jsonl"
    raw.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K_ROWS))
    verl = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a.rsplit("#### ", 1)[1]},
             "extra_info": {"split": "train", "index": i, "answer": a, "question": q}}
            for i, (q, a) in enumerate(GSM8K_ROWS)]
    datasets.Dataset.from_list(verl).to_parquet(str(tmp_path / "verl_gsm8k.parquet"))
    math = [{**r, "data_source": "DigitalLearningGmbH/MATH-lighteval", "extra_info": {"split": "train", "index": 0}}
            for r in verl]
    datasets.Dataset.from_list(math).to_parquet(str(tmp_path / "verl_math.parquet"))
    return tmp_path


def _warnings(caplog, files, response_length):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf.config"):
        config_problems(compose_config([f"data.train_files={files}", f"data.val_files={files}",
                                        "data.max_prompt_length=200", "data.train_batch_size=2",
                                        "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
                                        f"data.max_response_length={response_length}"]),
                        world_size=1, check_files=True)
    return [r.getMessage() for r in caplog.records if "reference solutions" in r.getMessage()]


def test_response_length_against_the_reference_solutions(data, caplog):
    """A response limit shorter than most reference solutions is named at --cfg with the length that fits them
    (their token counts + EOS with the run's tokenizer); GSM8K's raw answer column and verl's extra_info.answer
    read alike; a bare ground truth (verl's MATH layout) or a limit that fits half of them gives no warning."""
    from rlhf.quickstart.tokenizer import make_quickstart_tokenizer

    tok = make_quickstart_tokenizer()
    need = sorted(len(tok(a, add_special_tokens=False)["input_ids"]) + 1 for _, a in GSM8K_ROWS)
    assert need[0] < need[1] < need[2]
    for name, column in (("gsm8k.jsonl", "answer"), ("verl_gsm8k.parquet", "extra_info.answer")):
        files = data / name
        train, val = _warnings(caplog, files, need[1] - 1)
        assert train == (
            f"rlhf.config: data.max_response_length={need[1] - 1} is shorter than 2 of the 3 reference solutions of "
            f"data.train_files='{files}' (67%; column {column}: {need[0]}..{need[2]} tokens, median {need[1]}, with "
            f"the tokenizer of tiny://quickstart): a response written like them is cut before its final answer and "
            f"scores 0; set data.max_response_length={need[2]} to fit 95% of them ({need[2]}: all), keeping "
            f"data.max_prompt_length + data.max_response_length within the model's context.")
        assert val.startswith(f"rlhf.config: data.max_response_length={need[1] - 1} is shorter than 2 of the 3 "
                              f"reference solutions of data.val_files=")
        assert _warnings(caplog, files, need[1]) == []  # half of them fit
    assert _warnings(caplog, data / "verl_math.parquet", 8) == []
