"""Everything the PPO loop needs, built once: distributed state, models, optimizers, data,
rollout engines, weight bridge, KL controller, metrics, checkpoints (see `build_trainer`)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rlhf.mcore.distributed import init_distributed, init_model_parallel, set_seed
from rlhf.mcore.models import ModelBundle, build_model_chunks
from rlhf.mcore.optim import OptimConfig, TrainState, build_train_state


def _optim(cfg_optim) -> OptimConfig:
    return OptimConfig(**{k: cfg_optim[k] for k in OptimConfig.__dataclass_fields__ if k in cfg_optim})


def _to_container(x):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(x, resolve=True) if OmegaConf.is_config(x) else x


@dataclass
class TrainerSetup:
    cfg: Any
    tokenizer: Any
    hf_config: Any
    model_path: str
    actor: ModelBundle
    actor_state: TrainState
    reference: ModelBundle | None
    critic: ModelBundle | None
    critic_state: TrainState | None
    train_loader: Any
    val_dataset: Any
    train_sampling: Any
    val_sampling: Any
    kl_ctrl: Any
    tracker: Any
    rollout: Any = None  # RolloutManager on rank 0
    bridge: Any = None
    reward: Any = None  # rlhf.rewards.sources.RewardSources on rank 0
    start_step: int = 0
    total_steps: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.actor.spec.vocab_size

    # ---- rollout helpers ----------------------------------------------------------------
    def rollout_release(self) -> None:
        """Colocated on GPU: free the engines' memory while the trainer computes."""
        if dist.get_rank() == 0 and self.cfg.rollout.mode == "colocated" and torch.cuda.is_available():
            self.rollout.release_memory_occupation()

    def rollout_resume(self) -> None:
        if dist.get_rank() == 0 and self.cfg.rollout.mode == "colocated" and torch.cuda.is_available():
            self.rollout.resume_memory_occupation()

    def sync_weights(self):
        """Stream the actor's weights into every engine (collective over all trainer ranks)."""
        self.rollout_resume()
        stats = self.bridge.sync()
        self.rollout_release()
        return stats

    def val_batches(self):
        from rlhf.data.loader import StatefulPromptLoader

        n = len(self.val_dataset)
        bs = min(self.cfg.data.val_batch_size, n)
        loader = StatefulPromptLoader(self.val_dataset, bs, shuffle=False, drop_last=False, collate_fn=_collate)
        return iter(loader)

    # ---- checkpoints / export --------------------------------------------------------------
    def roles(self) -> dict:
        roles = {"actor": self.actor_state}
        if self.critic_state is not None:
            roles["critic"] = self.critic_state
        return roles

    def save(self, step: int) -> str:
        from rlhf.checkpointing import checkpoint_root, save_checkpoint

        state = {"train_loader": self.train_loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict()}
        return save_checkpoint(checkpoint_root(self.cfg.trainer.default_local_dir), step, self.roles(), state,
                               self.cfg.trainer.max_ckpt_to_keep)

    def export_hf(self) -> str:
        from rlhf.mcore.convert import save_hf_checkpoint

        out = os.path.join(self.cfg.trainer.default_local_dir, "hf_export")
        save_hf_checkpoint(self.actor.chunks, self.actor.spec, self.hf_config, out, tokenizer=self.tokenizer)
        return out

    def progress_bar(self):
        if dist.get_rank() != 0 or not self.cfg.trainer.progress_bar:
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.start_step, desc="PPO", dynamic_ncols=True)

    def close(self) -> None:
        self.tracker.close()
        if self.reward is not None:
            self.reward.close()
        if self.bridge is not None:
            self.bridge.close()
        if self.rollout is not None:
            self.rollout.shutdown()


class RolloutSink:
    """Presents a RolloutManager (several engines) as one weight-bridge sink: every call goes to all
    engines; `expected_weights` is the first engine's (all engines serve the same model)."""

    def __init__(self, manager):
        self.manager = manager

    def expected_weights(self):
        import ray

        return ray.get(self.manager.actors[0].expected_weights.remote())

    def begin_weight_update(self):
        return self.manager.begin_weight_update()

    def update_weights_from_tensor(self, named_tensors):
        return self.manager.update_weights_from_tensor(named_tensors)

    def end_weight_update(self):
        return self.manager.end_weight_update()

    def flush_cache(self):
        import ray

        if hasattr(self.manager, "flush_cache"):
            return self.manager.flush_cache()
        return ray.get([a.flush_cache.remote() for a in self.manager.actors])

    def get_weights_by_name(self, name, truncate_size=100):
        import ray

        return ray.get(self.manager.actors[0].get_weights_by_name.remote(name, truncate_size))

    def init_weights_update_group(self, *args, **kwargs):
        return self.manager.init_weights_update_group_async(*args, **kwargs)

    def update_weights_from_distributed_async(self, *args, **kwargs):
        return self.manager.update_weights_from_distributed_async(*args, **kwargs)


def _collate(items):
    return {"input_ids_list": [list(it["input_ids"]) for it in items],
            "data_source": [it["data_source"] for it in items], "ground_truth": [it["ground_truth"] for it in items],
            "extra_info": [it.get("extra_info") or {} for it in items], "index": [it["index"] for it in items],
            "raw_prompt": [it.get("raw_prompt") for it in items]}


def _resolve_data(files, cfg, split: str) -> Any:
    """embedded://arithmetic -> parquet written by rank 0 under default_local_dir/data."""
    if isinstance(files, str) and files.startswith("embedded://"):
        task = files[len("embedded://"):]
        if task != "arithmetic":
            raise ValueError(f"data files {files!r}: the embedded task is 'embedded://arithmetic'")
        out = os.path.join(cfg.trainer.default_local_dir, "data")
        if dist.get_rank() == 0:
            from rlhf.quickstart.arithmetic import write_arithmetic_parquet

            write_arithmetic_parquet(out, cfg.data.embedded_num_train, cfg.data.embedded_num_val, seed=cfg.data.seed,
                                     **_embedded_task_kwargs(cfg.data.embedded_max_operand))
        dist.barrier()
        return os.path.join(out, "train.parquet" if split == "train" else "test.parquet")
    return _to_container(files)


def _embedded_task_kwargs(max_operand: int) -> dict:
    """The embedded task in exactly the form the tiny://quickstart model was warmed up on."""
    from rlhf.quickstart.arithmetic import quickstart_task_kwargs

    return dict(quickstart_task_kwargs(max_operand))


def _resolve_model(cfg) -> str:
    path = cfg.model.path
    if path.startswith("tiny://"):
        from rlhf.quickstart.model import resolve_model_path

        cache = os.path.join(cfg.trainer.default_local_dir, "tiny_model")
        if dist.get_rank() == 0:
            resolve_model_path(path, cache, warmup_steps=cfg.model.warmup_steps, warmup_lr=cfg.model.warmup_lr,
                               max_operand=cfg.data.embedded_max_operand)
        dist.barrier()
        return resolve_model_path(path, cache, warmup_steps=cfg.model.warmup_steps, warmup_lr=cfg.model.warmup_lr,
                               max_operand=cfg.data.embedded_max_operand)
    if not os.path.isdir(path):
        if dist.get_rank() == 0:
            from huggingface_hub import snapshot_download

            snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])
        dist.barrier()
        from huggingface_hub import snapshot_download

        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])
    return path


def _start_rollout(cfg, model_path: str):
    import ray

    from rlhf.rollout import RolloutManager

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        else:
            ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    engine_kwargs = dict(model_path=model_path, tp_size=cfg.rollout.tensor_model_parallel_size, dtype=cfg.rollout.dtype,
                         mem_fraction_static=cfg.rollout.mem_fraction_static if torch.cuda.is_available() else None,
                         context_length=cfg.data.max_prompt_length + cfg.data.max_response_length + 8,
                         random_seed=cfg.trainer.seed)
    return RolloutManager(cfg.rollout.num_engines, engine_kwargs, placement=cfg.rollout.mode,
                          max_restarts=cfg.rollout.max_restarts, retain_latest_weights=not torch.cuda.is_available())


def build_trainer(cfg) -> TrainerSetup:
    """Collective: set up everything for `rlhf.trainer.run` from the composed config."""
    from transformers import AutoConfig, AutoTokenizer

    from rlhf import algorithms as algos
    from rlhf.data.loader import StatefulPromptLoader
    from rlhf.data.rl_dataset import RLDataset
    from rlhf.rollout import SamplingConfig
    from rlhf.tracking import Tracking

    init_distributed()
    p = cfg.parallel
    init_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                        p.virtual_pipeline_model_parallel_size)
    set_seed(cfg.trainer.seed)
    rank0 = dist.get_rank() == 0
    out_dir = cfg.trainer.default_local_dir
    if rank0:
        os.makedirs(out_dir, exist_ok=True)
    model_path = _resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    hf_config = AutoConfig.from_pretrained(model_path)

    # data
    train_ds = RLDataset(_resolve_data(cfg.data.train_files, cfg, "train"), tokenizer, cfg.data.max_prompt_length,
                         prompt_key=cfg.data.prompt_key, max_samples=cfg.data.max_train_samples)
    val_ds = RLDataset(_resolve_data(cfg.data.val_files, cfg, "val"), tokenizer, cfg.data.max_prompt_length,
                       prompt_key=cfg.data.prompt_key, max_samples=cfg.data.max_val_samples)
    loader = StatefulPromptLoader(train_ds, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed,
                                  drop_last=True, collate_fn=_collate)
    total_steps = cfg.trainer.total_training_steps or len(loader) * cfg.trainer.total_epochs

    # models
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    common = dict(make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by, params_dtype=dtype,
                  sequence_parallel=p.sequence_parallel, recompute=p.recompute)
    actor = build_model_chunks(hf_config, "actor", model_path, **common)
    actor_state = build_train_state(actor.chunks, actor.config, _optim(cfg.actor.optim))
    need_ref = cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss
    reference = build_model_chunks(hf_config, "reference", model_path, **common) if need_ref else None
    use_critic = cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.adv_estimator == "gae"
    if use_critic and cfg.algorithm.adv_estimator != "gae" and rank0:
        print(f"note: critic.enable=true with algorithm.adv_estimator={cfg.algorithm.adv_estimator}: a critic is "
              f"trained but its values are unused (critic.enable=null builds one only for gae)", flush=True)
    critic = critic_state = None
    if use_critic:
        critic_path = cfg.model.critic_path or model_path
        critic = build_model_chunks(AutoConfig.from_pretrained(critic_path), "critic", critic_path, **common)
        critic_state = build_train_state(critic.chunks, critic.config, _optim(cfg.critic.optim))

    # rollout + weight bridge
    rollout = None
    from rlhf.rollout.sampling import stop_token_ids_for

    stop_ids = stop_token_ids_for(model_path)
    r = cfg.rollout
    train_sampling = SamplingConfig(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                    max_new_tokens=cfg.data.max_response_length, stop_token_ids=stop_ids)
    v = r.val_kwargs
    val_sampling = SamplingConfig(n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k,
                                  max_new_tokens=cfg.data.max_response_length, stop_token_ids=stop_ids)
    if rank0:
        rollout = _start_rollout(cfg, model_path)
    dist.barrier()
    from rlhf.mcore.weight_sync import WeightBridge

    bridge = WeightBridge(actor.chunks, actor.spec, [RolloutSink(rollout)] if rank0 else None,
                          transport="tensor" if r.mode == "colocated" else "distributed",
                          bucket_bytes=r.weight_sync_bucket_mb << 20,
                          check="sample" if r.weight_sync_check else None)

    kc = cfg.algorithm.kl_ctrl
    kl_ctrl = algos.get_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)
    reward = None
    if rank0:  # the reward (rule / custom / reward-model sources, rlhf/rewards/sources.py) runs on rank 0
        from rlhf.rewards.manager import build_reward_sources

        reward = build_reward_sources(cfg.reward)
    tracker = Tracking(os.path.join(out_dir, "tensorboard"), backends=list(cfg.trainer.logger), enabled=rank0)
    s = TrainerSetup(cfg=cfg, tokenizer=tokenizer, hf_config=hf_config, model_path=model_path, actor=actor,
                     actor_state=actor_state, reference=reference, critic=critic, critic_state=critic_state,
                     train_loader=loader, val_dataset=val_ds, train_sampling=train_sampling,
                     val_sampling=val_sampling, kl_ctrl=kl_ctrl, tracker=tracker, rollout=rollout, bridge=bridge,
                     reward=reward, total_steps=total_steps)
    _maybe_resume(s)
    return s


def _maybe_resume(s: TrainerSetup) -> None:
    from rlhf.checkpointing import checkpoint_root, latest_checkpoint, load_checkpoint

    t = s.cfg.trainer
    if t.resume_mode == "disable":
        return
    if t.resume_mode == "resume_path":
        if not t.resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<checkpoint dir>")
        path = t.resume_from_path
    else:
        path = latest_checkpoint(checkpoint_root(t.default_local_dir))
        if path is None:
            return
    state = load_checkpoint(path, s.roles())
    s.train_loader.load_state_dict(state["train_loader"])
    s.kl_ctrl.load_state_dict(state["kl_ctrl"])
    s.start_step = int(state["step"])
    s.sync_weights()  # engines start from the HF weights; give them the resumed actor
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {s.start_step}", flush=True)
