"""The GSM8K tool GPU recipe (recipes/gsm8k_multiturn_qwen2_5_3b, verl's run_qwen2.5-3b_gsm8k_multiturn.sh): it
composes at ``--cfg job`` with verl's values and tool config from any CWD, and its prepare_data.py writes verl's
multi-turn rows (examples/data_preprocess/gsm8k_multiturn_w_tool.py), which the trainer reads as such."""
from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from rlhf.agent.config import load_tool_specs, resolve_class
from rlhf.agent.tools import Gsm8kTool
from tests.support.paths import REPO

NAME = "gsm8k_multiturn_qwen2_5_3b"


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(k, raising=False)


def test_composes_at_cfg_with_verls_values_from_another_cwd(tmp_path, monkeypatch, capsys):
    from rlhf.main import main

    raw = REPO / ".." / "shared" / "data" / "gsm8k"
    if not (raw / "train.jsonl").is_file():
        pytest.skip("no shared GSM8K copy")
    monkeypatch.chdir(tmp_path)  # the tool config is found under the repository root
    code = main([f"recipe={NAME}", f"data.train_files={raw / 'train.jsonl'}", f"data.val_files={raw / 'test.jsonl'}",
                 "--cfg", "job"])
    out, err = capsys.readouterr()
    assert code == 0, err
    c = yaml.safe_load(out)
    mt = c["rollout"]["multi_turn"]
    assert mt["enable"] is True and mt["max_assistant_turns"] == 5 and mt["format"] == "hermes"
    assert c["algorithm"]["adv_estimator"] == "grpo" and c["rollout"]["n"] == 16
    assert (c["data"]["train_batch_size"], c["data"]["max_prompt_length"], c["data"]["max_response_length"]) == \
        (256, 1024, 1024)
    assert c["actor"]["use_kl_loss"] is True and c["actor"]["kl_loss_coef"] == 0.001 and \
        c["actor"]["kl_loss_type"] == "low_var_kl" and c["actor"]["optim"]["lr"] == 1e-6
    assert c["model"]["path"] == "Qwen/Qwen2.5-3B-Instruct"
    [spec] = load_tool_specs(mt["tool_config_path"])
    assert spec.name == "calc_gsm8k_reward" and spec.class_name == "verl.tools.gsm8k_tool.Gsm8kTool"
    assert resolve_class(spec.class_name, "tool") is Gsm8kTool


def test_prepare_data_writes_verls_rows(tmp_path):
    spec = importlib.util.spec_from_file_location("prep", REPO / "recipes" / NAME / "prepare_data.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    src = tmp_path / "raw"
    src.mkdir()
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text(json.dumps({"question": "Tom has 3 apples and buys 1,002. How many?",
                                                        "answer": "3 + 1002 = 1005\n#### 1,005"}) + "\n")
    assert prep.main(["--src", str(src), "--out", str(tmp_path / "out")]) == 0
    [row] = [json.loads(x) for x in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    q = "Tom has 3 apples and buys 1,002. How many? Let's think step by step and output the final answer after `####`."
    assert row["prompt"][1] == {"role": "user", "content": q} and row["prompt"][0]["role"] == "system"
    assert "`calc_gsm8k_reward` tool" in row["prompt"][0]["content"]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "1005"}
    assert row["extra_info"]["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "1005"}}}
    assert row["extra_info"]["interaction_kwargs"] == {"query": q, "ground_truth": "1005"}
    from rlhf.data.prompts import normalize_row

    n = normalize_row(row)
    assert n["ground_truth"] == "1005" and n["data_source"] == "openai/gsm8k" and len(n["prompt"]) == 2
    assert n["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"] == "1005"
