"""Demo: build a tiny random Qwen2 (tied) model, convert HF -> megatron (TP2) -> HF, check bitwise.

    python scripts/demo_convert_roundtrip.py [--workdir outputs/demo_roundtrip]
"""
import argparse
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=os.path.join(ROOT, "outputs", "demo_roundtrip"))
    args = ap.parse_args()
    import torch
    from safetensors.torch import load_file

    from tests.support.tiny_models import make_tiny_hf_model
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    hf = make_tiny_hf_model(os.path.join(args.workdir, "hf"), "qwen2_tied", vocab_size=400,
                            tokenizer=make_tiny_tokenizer())
    script = os.path.join(ROOT, "scripts", "convert_checkpoint.py")
    mcore, back = os.path.join(args.workdir, "mcore"), os.path.join(args.workdir, "hf_back")
    subprocess.check_call([sys.executable, script, "hf-to-mcore", "--hf-path", hf, "--out", mcore, "--tp", "2"])
    subprocess.check_call([sys.executable, script, "mcore-to-hf", "--mcore-path", mcore, "--out", back])
    a, b = load_file(os.path.join(hf, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    same = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    print(f"round trip HF -> megatron(TP2) -> HF: {len(a)} tensors, bitwise equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
