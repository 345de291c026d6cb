"""Writes fixtures/rollout_corr_verl.json: verl's own rollout-correction functions (rollout_corr_helper.py,
core_algos.compute_policy_loss_bypass_mode, utils/debug/metrics.calculate_debug_metrics) run on fixed inputs, after
checking that rlhf.algorithms.rollout_corr gives the same numbers.  verl's files are extracted from a verl git
directory into a scratch folder with stubs for what they import but do not use (tensordict, DataProto, config
classes); no verl code is kept in this repository::

    PYTHONPATH=. python tests/support/rollout_corr_verl_fixture.py /work/.mirror/volcengine+verl/repo \
        tests/support/fixtures/rollout_corr_verl.json
"""
import json, os, subprocess, sys, tempfile
import torch

STUBS = {
    "tensordict/__init__.py": "TensorDict = dict\n",
    "verl/__init__.py": "", "verl/trainer/__init__.py": "", "verl/trainer/ppo/__init__.py": "",
    "verl/utils/debug/__init__.py": "", "verl/workers/__init__.py": "",
    "verl/utils/__init__.py": "def as_torch_index(*a, **k): raise NotImplementedError\n"
                              "def group_mean_std(*a, **k): raise NotImplementedError\n",
    "verl/utils/import_utils.py": "def deprecated(*a, **k):\n    return lambda f: f\n",
    "verl/protocol.py": "class DataProto:\n    def __init__(self, batch): self.batch = batch\n"
                        "    @classmethod\n    def from_dict(cls, tensors): return cls(dict(tensors))\n",
    "verl/trainer/config/__init__.py": "class AlgoConfig: pass\n",
    "verl/trainer/config/algorithm.py": "class RolloutCorrectionConfig(dict): pass\n",
    "verl/workers/config/__init__.py": "class ActorConfig: pass\n",
    "verl/workers/config/actor.py": "class PolicyLossConfig(dict): pass\n",
}
FILES = ["verl/trainer/ppo/rollout_corr_helper.py", "verl/utils/torch_functional.py", "verl/trainer/ppo/core_algos.py",
         "verl/utils/debug/metrics.py", "verl/utils/device.py"]


def extract(git_dir: str) -> str:
    root = tempfile.mkdtemp(prefix="verl_rollout_corr_")
    for rel, text in STUBS.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        open(os.path.join(root, rel), "w").write(text)
    for rel in FILES:
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        text = subprocess.run(["git", "--git-dir", git_dir, "show", f"HEAD:{rel}"], check=True, capture_output=True,
                              text=True).stdout
        open(os.path.join(root, rel), "w").write(text)
    return root


sys.path.insert(0, extract(sys.argv[1]))
import verl.trainer.ppo.rollout_corr_helper as vh
import verl.trainer.ppo.core_algos as vc
import verl.utils.debug.metrics as vd
from verl.protocol import DataProto
from rlhf.algorithms import rollout_corr as ours
from rlhf.algorithms.policy_losses.bypass import compute_policy_loss_bypass_mode
from rlhf.algorithms.config_access import ConfigOverlay

g = torch.Generator().manual_seed(0)
B, R = 5, 7
rollout = -torch.rand(B, R, generator=g) * 3
old = rollout + torch.randn(B, R, generator=g) * 0.4
mask = torch.ones(B, R)
for i, L in enumerate([7, 5, 3, 1, 6]):
    mask[i, L:] = 0
cases = [dict(rollout_is="token"), dict(rollout_is="sequence"), dict(rollout_is="token", rollout_is_batch_normalize=True),
         dict(rollout_is="sequence", rollout_is_threshold=5.0, rollout_is_batch_normalize=True),
         dict(rollout_rs="token_k1", rollout_rs_threshold="0.6_1.5"),
         dict(rollout_rs="token_k1", rollout_rs_threshold=1.5),
         dict(rollout_rs="token_k2,seq_sum_k3,seq_mean_k1,seq_max_k2", rollout_rs_threshold="0.1,0.5,0.8_1.2,0.2"),
         dict(rollout_rs="seq_mean_k3,seq_max_k3,seq_sum_k1,seq_sum_k2,seq_mean_k2,token_k3", rollout_rs_threshold="0.05"),
         dict(rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.9_1.1")]
worst = 0.0
fixture = {"rollout_log_probs": rollout.tolist(), "old_log_probs": old.tolist(), "response_mask": mask.tolist(), "cases": []}
for kw in cases:
    w1, m1, met1 = vh.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kw)
    w2, m2, met2 = ours.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kw)
    assert set(met1) == set(met2), (kw, set(met1) ^ set(met2))
    for k in met1:
        d = abs(met1[k] - met2[k]); worst = max(worst, d / max(1, abs(met1[k])))
        assert d <= 1e-5 * max(1, abs(met1[k])), (kw, k, met1[k], met2[k])
    assert torch.equal(m1, m2), kw
    if w1 is not None:
        assert torch.allclose(w1.batch["rollout_is_weights"], w2, rtol=1e-6, atol=1e-7), kw
    fixture["cases"].append({"kwargs": kw, "metrics": met1, "mask": m1.tolist(),
                             "weights": None if w1 is None else w1.batch["rollout_is_weights"].tolist()})
    print("ok", kw, len(met1), "metrics")
# debug metrics
vb = DataProto({"rollout_log_probs": rollout, "old_log_probs": old, "response_mask": mask, "responses": torch.zeros(B, R)})
d1 = vd.calculate_debug_metrics(vb); d2 = ours.calculate_debug_metrics(old, rollout, mask)
for k in d1:
    assert abs(d1[k] - d2[k]) < 1e-6, (k, d1[k], d2[k])
fixture["debug_metrics"] = d1
print("debug ok", d1)
# actor-side metrics
a1 = vh.compute_rollout_corr_metrics_from_logprobs(old, rollout, mask); a2 = ours.compute_rollout_corr_metrics_from_logprobs(old, rollout, mask)
assert all(abs(a1[k] - a2[k]) < 1e-5 for k in a1) and set(a1) == set(a2)
# bypass loss
from types import SimpleNamespace
adv = torch.randn(B, R, generator=g)
for rc in [dict(loss_type="ppo_clip", rollout_is="token", rollout_is_threshold=2.0),
           dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4"),
           dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=3.0)]:
    for agg in ["token-mean", "seq-mean-token-sum"]:
        vcfg = SimpleNamespace(policy_loss={"rollout_correction": rc}, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                               global_batch_info={}, get=lambda k, d=None: {"clip_ratio_c": 3.0}.get(k, d))
        l1, pm1 = vc.compute_policy_loss_bypass_mode(rollout, old, adv, mask, agg, vcfg)
        ocfg = {"policy_loss": {"rollout_correction": rc}, "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
        l2, pm2 = compute_policy_loss_bypass_mode(rollout, old, adv, mask, agg, ocfg)
        assert abs(l1.item() - l2.item()) < 1e-6, (rc, agg, l1, l2)
        for k in pm1:
            v1 = pm1[k]; v2 = pm2[k]
            v1 = v1.item() if torch.is_tensor(v1) else v1; v2 = v2.item() if torch.is_tensor(v2) else v2
            assert abs(v1 - v2) <= 1e-5 * max(1, abs(v1)), (k, v1, v2)
        fixture.setdefault("bypass", []).append({"rc": rc, "agg": agg, "loss": l1.item(),
                                                 "metrics": {k: (v.item() if torch.is_tensor(v) else v) for k, v in pm1.items()}})
        print("bypass ok", rc["loss_type"], agg, l1.item())
fixture["advantages"] = adv.tolist()
print("worst rel diff", worst)
json.dump(fixture, open(sys.argv[2], "w"), indent=None)
