"""SGLangEngine.load_lora_adapter over a stand-in sglang.Engine: each load gets a new name, the previous adapter is
unloaded only after the new one loaded, every later generate request names the adapter (lora_path), the weight
version counts the loads, and a refused load raises and leaves the serving adapter in place."""
import pytest
import torch

from rlhf.rollout.sampling import SamplingConfig
from rlhf.rollout.sglang_engine import EngineCallError, SGLangEngine


class _Result:
    def __init__(self, success, error_message=""):
        self.success, self.error_message = success, error_message


class _Sgl:
    def __init__(self):
        self.calls, self.refuse = [], False

    def load_lora_adapter_from_tensors(self, name, tensors, config):
        self.calls.append(("load", name, sorted(tensors), config["r"]))
        return _Result(not self.refuse, "bad adapter" if self.refuse else "")

    def unload_lora_adapter(self, name):
        self.calls.append(("unload", name))
        return _Result(True)

    def generate(self, input_ids, sampling_params, return_logprob, lora_path=None):
        self.calls.append(("generate", lora_path))
        return [{"output_ids": [4], "meta_info": {"finish_reason": {"type": "stop"},
                                                  "output_token_logprobs": [(-0.5, 4, None)]}} for _ in input_ids]


def test_adapter_loads_rotate_names_and_generation_uses_the_latest():
    eng = object.__new__(SGLangEngine)
    sgl = _Sgl()
    eng.engine, eng.weight_version = sgl, 3
    greedy = SamplingConfig(n=2, temperature=0.0, max_new_tokens=4)
    eng.generate([[1, 2]], greedy)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 4)}
    assert eng.load_lora_adapter(tensors, {"r": 8}) == 4
    eng.generate([[1, 2]], greedy)
    assert eng.load_lora_adapter(tensors, {"r": 8}) == 5
    out = eng.generate([[1, 2], [3]], greedy)
    assert [s.weight_version for s in out] == [5] * 4
    assert sgl.calls == [("generate", None),
                         ("load", "actor_v4", sorted(tensors), 8), ("generate", ["actor_v4"] * 2),
                         ("load", "actor_v5", sorted(tensors), 8), ("unload", "actor_v4"),
                         ("generate", ["actor_v5"] * 4)]
    sgl.refuse = True
    with pytest.raises(EngineCallError, match="load_lora_adapter_from_tensors failed: bad adapter"):
        eng.load_lora_adapter(tensors, {"r": 8})
    assert (eng.lora_name, eng.weight_version) == ("actor_v5", 5)
