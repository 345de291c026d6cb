"""scripts/convert_checkpoint.py: HF -> megatron (TP2, 2 processes) -> HF is bitwise exact."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.tiny_models import make_tiny_hf_model
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
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
