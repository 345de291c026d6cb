"""scripts/convert_checkpoint.py: HF -> megatron (TP2, 2 processes) -> HF is bitwise exact."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.support.tiny_models import make_tiny_hf_model
from tests.support.tiny_tokenizer import make_tiny_tokenizer

from tests.support.paths import ROOT
SCRIPT = os.path.join(ROOT, "scripts", "convert_checkpoint.py")


@pytest.mark.slow
@pytest.mark.dist
def test_convert_round_trip_cli(tmp_path):
    hf = make_tiny_hf_model(str(tmp_path / "hf"), "qwen2_tied", vocab_size=400, tokenizer=make_tiny_tokenizer())
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for cmd in (["hf-to-mcore", "--hf-path", hf, "--out", str(tmp_path / "mcore"), "--tp", "2", "--pp", "1"],
                ["mcore-to-hf", "--mcore-path", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf2")]):
        proc = subprocess.run([sys.executable, SCRIPT, *cmd], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a = load_file(os.path.join(hf, "model.safetensors"))
    b = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert set(a) == set(b) and "lm_head.weight" not in b
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (tmp_path / "hf2" / "tokenizer.json").exists()
    assert not (tmp_path / "mcore.tmp").exists()


def _run(cmd, env):
    return subprocess.run([sys.executable, SCRIPT, *cmd], env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.dist
def test_convert_moe_round_trip_with_expert_parallelism(tmp_path):
    """Qwen3-MoE: HF -> megatron at EP2 -> HF at TP2 (experts resharded over EP then TP) is bitwise."""
    from tests.support.model_families import make_family_model

    hf = make_family_model(str(tmp_path / "hf"), "qwen3_moe", num_layers=2)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for cmd in (["hf-to-mcore", "--hf-path", hf, "--out", str(tmp_path / "mcore"), "--ep", "2"],
                ["mcore-to-hf", "--mcore-path", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf2"), "--tp", "2"]):
        proc = _run(cmd, env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a = load_file(os.path.join(hf, "model.safetensors"))
    b = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert set(a) == set(b) and "model.layers.1.mlp.experts.7.down_proj.weight" in b
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_convert_refuses_unsupported_model_before_any_work(tmp_path):
    """Exit code 2 with the supported list, from config.json alone (no weights in the directory)."""
    from transformers import GPT2Config

    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(str(tmp_path / "gpt2"))
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = _run(["hf-to-mcore", "--hf-path", str(tmp_path / "gpt2"), "--out", str(tmp_path / "m")], env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "GPT2LMHeadModel" in proc.stderr and "Qwen3MoeForCausalLM" in proc.stderr
    proc = _run(["hf-to-mcore", "--hf-path", str(tmp_path / "gpt2"), "--out", str(tmp_path / "m"), "--ep", "3"], env)
    assert proc.returncode == 2
