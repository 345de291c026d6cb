"""verl's Megatron users: verl's own config directory, override_transformer_config / override_optimizer_config
fields (mapped into megatron-core's TransformerConfig, or refused by name), the command line over a config
file, one error for every problem, and verl's Megatron example commands.  CPU, in-process, no torchrun."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from rlhf.config import ConfigValidationError, compose_config
from tests.support.mcore_checkpoints import write_dcp
from tests.support.verl_examples import example_args, examples, problems, run_cfg, write_verl_config_dir

VERL_MIRROR = Path("/work/.mirror/volcengine+verl/repo")


@pytest.fixture
def paths(tmp_path):
    """Tiny local data (one GSM8K-style row), model and megatron dist checkpoint (metadata only: the quickstart
    model's config.json is made at run time, so --cfg checks the format) for the examples' placeholders."""
    row = {"prompt": "What is 2 + 3?", "data_source": "openai/gsm8k", "question": "What is 2 + 3?",
           "answer": "2 + 3 = 5\n#### 5"}
    for name in ("train", "test"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    mcore = write_dcp(tmp_path / "mcore", {"embedding.word_embeddings.weight": (512, 64)})
    return {"train": str(tmp_path / "train.jsonl"), "test": str(tmp_path / "test.jsonl"),
            "model": "tiny://quickstart", "ckpt": str(tmp_path / "ckpt"), "mcore": mcore}


def _mirror_config_dir(tmp_path: Path) -> Path:
    """verl/trainer/config of the fetched verl (extracted to ``tmp_path``); skips without a fetched copy."""
    if not VERL_MIRROR.exists():
        pytest.skip(f"no fetched copy of verl at {VERL_MIRROR}")
    git_dir = str(VERL_MIRROR / ".git") if (VERL_MIRROR / ".git").exists() else str(VERL_MIRROR)
    archive = subprocess.run(["git", "--git-dir", git_dir, "archive", "HEAD", "verl/trainer/config"],
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip("verl/trainer/config is not in the fetched copy")
    tmp_path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    return tmp_path / "verl" / "trainer" / "config"


def _base(paths) -> list[str]:
    return [f"data.train_files={paths['train']}", f"data.val_files={paths['test']}",
            f"actor_rollout_ref.model.path={paths['model']}", f"critic.model.path={paths['model']}"]


@pytest.mark.parametrize("tree", ["fixture", "verl"])
def test_verl_config_dir_defaults_do_not_conflict(tree, tmp_path, paths, monkeypatch):
    """--config-path <verl>/verl/trainer/config --config-name ppo_megatron_trainer with the actor at TP 2 / PP 2:
    verl's critic / reference defaults (TP 1, PP 1, VPP null) and its FSDP-only enable_gradient_checkpointing
    read as unset; a critic layout given on the command line that differs is refused with the fix."""
    conf = write_verl_config_dir(tmp_path) if tree == "fixture" else _mirror_config_dir(tmp_path)
    layout = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
              "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
              "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"]
    code, out, err = run_cfg(["--config-path", str(conf), "--config-name", "ppo_megatron_trainer", *_base(paths),
                              *layout])
    assert code == 0, err
    c = yaml.safe_load(out)
    p = c["parallel"]
    assert (p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"],
            p["virtual_pipeline_model_parallel_size"], p["recompute"]) == (2, 2, 2, None)
    assert c["actor"]["optim"]["lr"] == 1e-6 and c["critic"]["optim"]["lr"] == 1e-5
    # run from verl/trainer, as verl's --config-path=config is meant
    monkeypatch.chdir(conf.parent)
    code, _, err = run_cfg(["--config-path=config", "--config-name=ppo_megatron_trainer", *_base(paths), *layout,
                            "critic.megatron.tensor_model_parallel_size=4"])
    assert code == 2
    [line] = [p for p in problems(err) if p.startswith("critic.megatron")]
    assert "critic.megatron.tensor_model_parallel_size=4 is not supported" in line
    assert "set actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4" in line
    assert "or drop critic.megatron" in line


def test_fixture_config_dir_keys_are_verls(tmp_path):
    """The fixture's verl config directory holds only keys (and defaults) verl's own directory has."""
    real = _mirror_config_dir(tmp_path / "real")
    mine = yaml.safe_load((write_verl_config_dir(tmp_path / "mine") / "engine" / "megatron.yaml").read_text())
    theirs = yaml.safe_load((real / "engine" / "megatron.yaml").read_text())
    assert {k: v for k, v in theirs.items() if k in mine and k != "use_mbridge"} == \
        {k: v for k, v in mine.items() if k != "use_mbridge"}


TC = "+actor_rollout_ref.actor.megatron.override_transformer_config"


def test_transformer_config_fields_reach_megatron(caplog):
    """override_transformer_config fields with an equivalent set our keys (no "no effect" warning) and reach
    megatron-core's TransformerConfig: the uneven split changes the layers each stage builds (6 layers at PP 2:
    first stage 2, last 4; with the embedding and loss counted: 3 + 3 - 1 each = 2 + 2 at PP 2 of 6 layers)."""
    import transformers
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from parallel.model_config import transformer_config_from_hf
    from rlhf.workers.build import model_config_kwargs
    from tests.support.model_families import _COMMON, FAMILY_MODELS

    with caplog.at_level("WARNING", logger="rlhf.config"):
        c = compose_config(["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                            f"{TC}.num_layers_in_first_pipeline_stage=2", f"{TC}.num_layers_in_last_pipeline_stage=4",
                            f"{TC}.moe_aux_loss_coeff=0.01", f"{TC}.moe_z_loss_coeff=0.001",
                            f"{TC}.moe_router_dtype=fp32", f"{TC}.recompute_granularity=full",
                            f"{TC}.recompute_method=uniform", f"{TC}.recompute_num_layers=1"])
    assert not [r for r in caplog.records if "no effect" in r.getMessage()], caplog.text
    assert (c.parallel.num_layers_in_first_pipeline_stage, c.parallel.num_layers_in_last_pipeline_stage) == (2, 4)
    assert (c.model.moe_aux_loss_coef, c.model.moe_z_loss_coeff, c.model.moe_router_dtype) == (0.01, 0.001, "fp32")
    cls, kw = FAMILY_MODELS["qwen3_moe"]
    hf = getattr(transformers, cls)(**{**_COMMON, **kw, "num_hidden_layers": 6})
    tc = transformer_config_from_hf(hf, pp=2, ep=1, **{k: v for k, v in model_config_kwargs(c).items()
                                                       if k != "make_vocab_size_divisible_by"})
    assert (tc.moe_aux_loss_coeff, tc.moe_z_loss_coeff, tc.moe_router_dtype) == (0.01, 0.001, "fp32")
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "uniform", 1)
    assert [get_num_layers_to_build(tc, vp_stage=None, pp_rank=r) for r in (0, 1)] == [2, 4]

    c = compose_config(["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                        f"{TC}.account_for_embedding_in_pipeline_split=True",
                        f"{TC}.account_for_loss_in_pipeline_split=True",
                        "actor_rollout_ref.model.enable_gradient_checkpointing=True"])
    assert c.parallel.recompute == "full"  # verl's activation checkpointing = megatron's full recompute
    tc = transformer_config_from_hf(hf, pp=2, **{k: v for k, v in model_config_kwargs(c).items()
                                                 if k != "make_vocab_size_divisible_by"})
    assert tc.account_for_embedding_in_pipeline_split and tc.account_for_loss_in_pipeline_split
    assert [get_num_layers_to_build(tc, vp_stage=None, pp_rank=r) for r in (0, 1)] == [3, 3]  # (6 + 2) / 2 - 1
    with pytest.raises(ValueError, match=r"num_hidden_layers=6 \+ 1 .* does not split evenly over pp=2"):
        transformer_config_from_hf(hf, pp=2, account_for_embedding_in_pipeline_split=True)


def test_transformer_and_optimizer_fields_without_equivalent_are_refused_by_name():
    """Every other field is refused as not supported, naming it: never "Unknown config key" nor "no effect"."""
    with pytest.raises(ConfigValidationError) as e:
        compose_config([f"{TC}.dsa_indexer_loss_coeff=0.0", f"{TC}.moe_token_dispatcher_type=allgather",
                        "+actor_rollout_ref.actor.optim.override_optimizer_config.sgd_momentum=0.8",
                        "+actor_rollout_ref.actor.optim.override_optimizer_config.adam_eps=1e-6"])
    msg = str(e.value)
    for part in ("moe_token_dispatcher_type='allgather' is not supported", "alltoall or flex (DeepEP",
                 "dsa_indexer_loss_coeff=0.0 is not supported", "TransformerConfig field has no setting here",
                 "sgd_momentum=0.8 is not supported", "OptimizerConfig field has no setting here"):
        assert part in msg, part
    assert "Unknown config key" not in msg and "adam_eps=" not in msg
    c = compose_config(["+actor_rollout_ref.actor.optim.override_optimizer_config.adam_eps=1e-6",
                        "+actor_rollout_ref.actor.optim.override_optimizer_config.decoupled_weight_decay=True",
                        f"{TC}.moe_router_load_balancing_type=none"])
    assert c.actor.optim.adam_eps == 1e-6 and c.model.moe_aux_loss_coef == 0.0


def test_command_line_wins_over_a_refused_config_file_value(tmp_path):
    """A config file's skip_rollout: true is refused, unless the command line sets it back to false."""
    f = tmp_path / "run.yaml"
    f.write_text("actor_rollout_ref:\n  rollout:\n    skip_rollout: true\n")
    with pytest.raises(ConfigValidationError, match="skip_rollout=True is not supported"):
        compose_config([], config_file=f)
    compose_config(["actor_rollout_ref.rollout.skip_rollout=False"], config_file=f)


def test_one_error_holds_key_and_model_layout_problems(tmp_path, paths):
    """An unsupported key, a long chat template and a layout the model cannot take (TP 3 of 4 heads) come in one
    error before any model is built; the template is not printed whole."""
    from tests.unit.config.test_verl_compat import _model_dir

    model = _model_dir(tmp_path / "qwen")
    template = "{% for m in messages %}{{ m.content }}{% endfor %}" * 40
    code, _, err = run_cfg(["--cfg", f"data.train_files={paths['train']}", f"actor_rollout_ref.model.path={model}",
                            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
                            f"actor_rollout_ref.model.custom_chat_template='{template}'",
                            "actor_rollout_ref.rollout.skip_rollout=True"])
    assert code == 2
    lines = problems(err)
    assert any("skip_rollout=True is not supported" in p for p in lines), err
    assert any("tensor parallel size actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3 does not divide "
               "num_attention_heads=4" in p for p in lines), err
    [tpl] = [p for p in lines if "custom_chat_template" in p]
    assert f"({len(repr(template))} characters)" in tpl and len(tpl) < 400


#: what every verl Megatron example command gives here with its model / data paths swapped for tiny local ones
#: (None: composes; else parts of the refusal, each naming the unsupported feature).  docs/verl.md has the table.
OUTCOMES = {
    "gpg_trainer/run_qwen2-7b_math_megatron.sh": None,
    "grpo_trainer/run_deepseek671b_math_megatron_80gb.sh": ["tensor parallel size 32 does not fit on a node"],
    "grpo_trainer/run_deepseek671b_math_megatron_96gb.sh": ["tensor parallel size 32 does not fit on a node"],
    "grpo_trainer/run_deepseek7b_llm_math_megatron.sh": None,
    "grpo_trainer/run_moonlight16b_math_megatron.sh": ["trust_remote_code=True is not supported"],
    "grpo_trainer/run_qwen2-7b_math_megatron.sh": None,
    "grpo_trainer/run_qwen2-7b_math_megatron_lora.sh": None,  # LoRA
    "grpo_trainer/run_qwen2-7b_math_megatron_trtllm.sh": ["rollout.name='trtllm' is not supported"],
    "grpo_trainer/run_qwen2-7b_seq_balance_math_megatron.sh": None,  # param/grad/optimizer offload
    "grpo_trainer/run_qwen2-7b_sgl_megatron.sh": None,
    "grpo_trainer/run_qwen2_5-7b_math_megatron_diff_tp.sh": None,
    "grpo_trainer/run_qwen2_5_vl-7b-megatron.sh": None,  # megatron dist checkpoints (actor, reference)
    "grpo_trainer/run_qwen3-235b_megatron_96gb.sh": None,  # colocated under EP over nodes (was refused)
    "grpo_trainer/run_qwen3_vl-235b-megatron.sh": ["tensor parallel size 16 does not fit on a node"],
    "grpo_trainer/run_qwen3_vl-30b-megatron.sh": None,  # DeepEP (checked at start: CUDA, deep_ep)
    "grpo_trainer/run_qwen3_vl-8b-megatron.sh": None,
    "grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh": ["override_config.model_config.max_position_embeddings=10240 is "
                                                       "not supported"],
    "grpo_trainer/run_qwen3moe-30b_megatron_lora.sh": None,  # LoRA, context parallelism, offload
    "gspo_trainer/run_qwen30b_gspo.sh": None,
    "gspo_trainer/test_gspo_qwen30b_a3b_ep.sh": ["rollout.data_parallel_size=4 is not supported",
                                                 "expert parallelism inside the rollout engine is not supported"],
    "mtp_trainer/test_dapo_mimo_7b_with_mtp_math_megatron.sh": ["multi-token prediction is not supported",
                                                                "Prometheus metrics of the rollout servers",
                                                                "trust_remote_code=True is not supported"],
    "ppo_trainer/run_deepseek_full_hh_rlhf.sh": None,  # a reward model
    "ppo_trainer/run_deepseek_math_gsm8k_megatron.sh": None,
    "ppo_trainer/run_deepseek_math_gsm8k_megatron_nsys.sh": None,
    "ppo_trainer/run_moonlight16b_a3b_gsm8k_megatron.sh": ["trust_remote_code=True is not supported"],
    "ppo_trainer/run_qwen1.5_moe_a2.7b-gsm8k_megatron.sh": None,  # dist checkpoints for actor, reference, critic
    "ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh": None,
    # routing replay, DeepEP and the placement (colocated, PP6 x EP8 over 6 nodes) are taken
    # (tests/unit/config/test_router_replay_config.py)
    "router_replay/run_qwen30_a3b_megatron_sglang.sh": None,
    "router_replay/run_qwen30_a3b_megatron_vllm.sh": None,
    "sglang_multiturn/geo3k/run_qwen2.5-3b_megatron_geo3k_multiturn.sh": None,  # its config dir: multi-turn
    "sglang_multiturn/run_qwen2.5-3b_megatron_gsm8k_multiturn.sh": None,
    "tuning/32b/qwen2_32B_grpo_8_h20_megatron_vllm.sh": None,
    "recipe/dapo/test_dapo_7b_math_megatron.sh": None,  # colocated over 2 nodes: engines map their own GPUs' ranks
    "recipe/dapo/test_dapo_8b_megatron_fp16.sh": ["megatron.dtype='float16' is not supported", "fp16 training"],
    "recipe/dapo/test_dapo_8b_megatron_fp8train.sh": ["override_transformer_config.fp8='e4m3' is not supported"],
    "recipe/dapo/test_dapo_dspk_671b_megatron_96gb.sh": ["tensor parallel size 32 does not fit on a node"],
    "recipe/dapo/test_dapo_gptoss_20b_megatron.sh": None,
    "recipe/dapo/test_dapo_qwen3_moe_30b_megatron_fp16.sh": ["fp16 training"],
    "recipe/dapo/test_dapo_qwen3next_80b_megatron.sh": ["tensor parallel size 16 does not fit on a node"],
}
#: examples of each kind, also run with a verl config directory: PPO with a critic, GRPO, dynamic batching with
#: offload, DeepSeek-V3 on 96 GPUs, MoE with DeepEP, LoRA, multi-turn, fp16, rollout expert parallelism
REPRESENTATIVE = ["ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh", "grpo_trainer/run_qwen2-7b_math_megatron.sh",
                  "grpo_trainer/run_qwen2-7b_seq_balance_math_megatron.sh",
                  "grpo_trainer/run_deepseek671b_math_megatron_96gb.sh",
                  "grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh",
                  "grpo_trainer/run_qwen2-7b_math_megatron_lora.sh",
                  "sglang_multiturn/run_qwen2.5-3b_megatron_gsm8k_multiturn.sh",
                  "recipe/dapo/test_dapo_8b_megatron_fp16.sh", "gspo_trainer/test_gspo_qwen30b_a3b_ep.sh"]
#: problems of commands whose keys another part of the config owns (optimizer CPU offload), not judged here
_ELSEWHERE = ("override_optimizer_config.optimizer_cpu_offload", "override_optimizer_config.optimizer_offload_fraction",
              "override_optimizer_config.use_precision_aware_optimizer")


def _judge(name: str, code: int, err: str, expected) -> None:
    lines = [p for p in problems(err) if not any(k in p for k in _ELSEWHERE)]
    if expected is None:
        assert code == 0, err
        return
    assert code == 2, name
    for part in expected:
        assert any(part in p for p in lines), (part, err)
    # each names an unsupported feature, or is the placement (in verl's rollout replicas: rlhf.config.verl.words)
    assert all("is not supported" in p or re.match(r"\d+ rollout replica\(s\) \(\w+\) x ", p) for p in lines), err


@pytest.fixture
def wandb_offline(monkeypatch):
    """verl's examples log to wandb: offline here (no credentials is a problem of its own, tested elsewhere)."""
    monkeypatch.setenv("WANDB_MODE", "offline")


def test_fixture_holds_every_megatron_example():
    """The fixture's commands are verl's current set (39: examples/ and the verl-recipe submodule's dapo/)."""
    assert sorted(examples()) == sorted(OUTCOMES)


@pytest.mark.parametrize("name", list(OUTCOMES))
def test_verl_megatron_examples(name, paths, wandb_offline):
    """Every verl Megatron example command composes under --cfg with our base config (verl's --config-path=config
    without verl's directory), or is refused naming the unsupported feature.  Routing replay's examples get the
    tiny MoE model (on the dense one replay is refused at --cfg: test_router_replay_config.py)."""
    if name.startswith("router_replay/"):
        paths = dict(paths, model="tiny://quickstart-moe")
    _judge(name, *run_cfg(example_args(name, paths))[::2], OUTCOMES[name])


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_verl_megatron_examples_with_verl_config_dir(name, tmp_path, paths, wandb_offline):
    """The representative commands give the same with a verl config directory (the fixture's)."""
    if not examples()[name]["options"][0].endswith("=config") and "./config" not in examples()[name]["options"][0]:
        pytest.skip("its own config directory (the multi-turn examples' examples/sglang_multiturn/config)")
    _judge(name, *run_cfg(example_args(name, paths, write_verl_config_dir(tmp_path)))[::2], OUTCOMES[name])


@pytest.mark.slow
def test_fixture_is_the_extraction_of_the_fetched_verl():
    """The fixture equals tests/support/verl_examples.py:extract_examples of the fetched verl (and verl-recipe) it
    names; skips without those copies."""
    from tests.support.verl_examples import FIXTURE, extract_examples

    recipe = Path("/work/.mirror/verl-project+verl-recipe/repo")
    if not VERL_MIRROR.exists() or not recipe.exists():
        pytest.skip("no fetched copy of verl / verl-recipe")
    want = json.loads(FIXTURE.read_text())
    got = extract_examples(str(VERL_MIRROR), want["commit"], recipe_git_dir=str(recipe))
    assert got == want


def _mirror_tree(tmp_path: Path, *paths: str) -> Path:
    """``paths`` of the fetched verl extracted under ``tmp_path`` (verl's root); skips without a fetched copy."""
    if not VERL_MIRROR.exists():
        pytest.skip(f"no fetched copy of verl at {VERL_MIRROR}")
    archive = subprocess.run(["git", "--git-dir", str(VERL_MIRROR), "archive", "HEAD", *paths], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"{paths} not in the fetched copy")
    tmp_path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    return tmp_path


def test_verl_multiturn_gsm8k_example_with_its_config_folder(tmp_path, paths, monkeypatch, wandb_offline):
    """verl's multi-turn GSM8K Megatron example (examples/sglang_multiturn/run_qwen2.5-3b_megatron_gsm8k_multiturn.sh)
    run from verl's root with its own config folder (gsm8k_multiturn_megatron_grpo.yaml over verl/trainer/config)
    and tool config: composes with the agent loop on, verl's settings in rollout.multi_turn, and the tool config's
    class (verl.tools.gsm8k_tool.Gsm8kTool) mapped to ours."""
    from rlhf.agent.config import load_tool_specs, resolve_class
    from rlhf.agent.tools import Gsm8kTool

    root = _mirror_tree(tmp_path / "verl", "verl/trainer/config", "examples/sglang_multiturn/config")
    monkeypatch.chdir(root)
    name = "sglang_multiturn/run_qwen2.5-3b_megatron_gsm8k_multiturn.sh"
    code, out, err = run_cfg(example_args(name, paths, root / "examples" / "sglang_multiturn" / "config"))
    assert code == 0, err
    c = yaml.safe_load(out)
    mt = c["rollout"]["multi_turn"]
    assert mt["enable"] is True and mt["max_assistant_turns"] == 5 and mt["format"] == "hermes"
    assert mt["tool_config_path"] == "examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml"
    assert c["algorithm"]["adv_estimator"] == "grpo" and c["data"]["max_response_length"] == 1024
    [spec] = load_tool_specs(mt["tool_config_path"])
    assert spec.name == "calc_gsm8k_reward" and resolve_class(spec.class_name, "tool") is Gsm8kTool


def test_multi_turn_bad_settings_are_refused_at_cfg(tmp_path, paths):
    """A verl tool class not ported (Geo3kTool), an unknown tool-call format and a missing interaction file
    are named in one error at --cfg, each with the fix."""
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: verl.tools.geo3k_tool.Geo3kTool\n    config: {}\n"
                     "    tool_schema: {type: function, function: {name: calc_geo3k_reward}}\n")
    code, _, err = run_cfg(["--cfg", *_base(paths), "actor_rollout_ref.rollout.multi_turn.enable=True",
                            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
                            "actor_rollout_ref.rollout.multi_turn.format=nonesuch",
                            f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={tmp_path / 'none.yaml'}"])
    assert code == 2
    lines = problems(err)
    assert any("'verl.tools.geo3k_tool.Geo3kTool' is verl's and has no port here" in p
               for p in lines), err
    assert any("format='nonesuch' is not a tool-call format of SGLang's FunctionCallParser" in p for p in lines), err
    assert any("none.yaml' is not a file" in p for p in lines), err


def test_misspelt_tool_class_is_named_at_cfg(tmp_path, paths):
    """A misspelt verl tool class (Gsm8KTool) was refused as one of verl's classes "without a port": it is an unknown
    class, named with the nearest known one."""
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8KTool\n    config: {}\n"
                     "    tool_schema: {type: function, function: {name: calc_gsm8k_reward}}\n")
    code, _, err = run_cfg(["--cfg", *_base(paths), "actor_rollout_ref.rollout.multi_turn.enable=True",
                            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}"])
    assert code == 2
    assert any("unknown tool class 'verl.tools.gsm8k_tool.Gsm8KTool': not one of verl's; did you mean "
               "'verl.tools.gsm8k_tool.Gsm8kTool'?" in p for p in problems(err)), err
