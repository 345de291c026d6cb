"""Schema sections ``data``, ``model`` and ``parallel``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlhf.config.choices import ModelDtype, Recompute, Truncation
from rlhf.config.schema.rules import Checked, ge, ge_or_null, gt

__all__ = ["DataConfig", "LoRAConfig", "ModelConfig", "ParallelConfig"]


@dataclass
class DataConfig(Checked):
    # local parquet/jsonl file(s) or directory, a hub dataset NAME[:CONFIG][@SPLIT] (e.g. openai/gsm8k:main@train;
    # rlhf.config.data_refs), or embedded://arithmetic; a list mixes them
    train_files: Any = "embedded://arithmetic"
    val_files: Any = "embedded://arithmetic"
    prompt_key: str = "prompt"
    max_prompt_length: int = 64
    max_response_length: int = 32
    train_batch_size: int = 8  # prompts per PPO step (each gets rollout.n responses)
    val_batch_size: int = 32
    max_train_samples: Optional[int] = None
    max_val_samples: Optional[int] = None  # null: the whole validation set (verl); recipes may cap it
    shuffle: bool = True
    seed: int = 1
    # prompts longer than max_prompt_length: dropped (true), else handled by `truncation`
    filter_overlong_prompts: bool = True
    truncation: Truncation = Truncation.error
    apply_chat_template: Optional[bool] = None  # None: on iff the tokenizer has a chat template (off for base models)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra apply_chat_template kwargs
    embedded_num_train: int = 2000  # size of the generated embedded task
    embedded_num_val: int = 64
    embedded_max_operand: int = 9

    def problems(self, at: str = "") -> list[str]:
        out = ge(self, at, "max_prompt_length max_response_length train_batch_size val_batch_size", 1)
        out += ge_or_null(self, at, "max_train_samples max_val_samples", "use null for all samples")
        for k in ("train_files", "val_files"):
            v = getattr(self, k)
            if v is None or v == "" or (not isinstance(v, str) and hasattr(v, "__len__") and len(v) == 0):
                out.append(f"{at}{k}={v!r} is empty; give a .jsonl/.parquet path (or a list of them), a hub "
                           f"dataset such as openai/gsm8k, or embedded://arithmetic.")
        return out


@dataclass
class LoRAConfig(Checked):
    # LoRA on the actor (parallel.lora): rank 0 = off (full fine-tuning); the update B A is scaled by alpha / rank.
    # Base weights frozen, the reference is the actor with its adapters off, rollouts get the merged weights.
    rank: int = 0
    alpha: float = 16.0
    # all-linear, or a list of HF names (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; q/k/v and
    # gate/up together: megatron fuses them) or megatron names (linear_qkv linear_proj linear_fc1 linear_fc2)
    target_modules: Any = "all-linear"
    a_init: str = "xavier"  # init of A: xavier (verl's megatron default) or kaiming (PEFT's); B starts at 0

    def problems(self, at: str = "") -> list[str]:
        out = ge(self, at, "rank", 0, "0 switches LoRA off")
        if not self.rank:
            return out
        out += gt(self, at, "alpha", 0)
        if self.a_init not in ("xavier", "kaiming"):
            out.append(f"{at}a_init={self.a_init!r} must be one of [xavier, kaiming].")
        from parallel.lora import resolve_targets

        try:
            resolve_targets(self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules))
        except ValueError as e:
            out.append(f"{at}{e}.")
        return out


@dataclass
class ModelConfig(Checked):
    path: str = "tiny://quickstart"  # HF dir, hub name, or tiny://quickstart (built + warmed up locally)
    tokenizer_path: Optional[str] = None
    critic_path: Optional[str] = None  # defaults to `path` (value head freshly initialised)
    make_vocab_size_divisible_by: int = 128
    dtype: ModelDtype = ModelDtype.float32
    # MoE models: the router load-balancing (aux) loss coefficient; null: config.json's router_aux_loss_coef,
    # 0: off.  Logged as moe/load_balancing_loss (unweighted) with moe/tokens_per_expert_min/max.
    moe_aux_loss_coef: Optional[float] = None
    # MoE models: the router z-loss coefficient (ST-MoE, Zoph et al. 2022: mean squared logsumexp of the router
    # logits); null: off
    moe_z_loss_coeff: Optional[float] = None
    # MoE models: the dtype of the router's softmax / top-k (fp32 or fp64); null: the model dtype
    moe_router_dtype: Optional[str] = None
    # tiny://quickstart only: supervised warm-up so PPO starts with some signal
    warmup_steps: int = 300
    warmup_lr: float = 3e-3
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def problems(self, at: str = "") -> list[str]:
        out = [] if self.path else [f"{at}path is empty; give an HF directory, a hub name or tiny://quickstart."]
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            out.append(f"{at}moe_router_dtype={self.moe_router_dtype!r}: use fp32, fp64 or null (the model dtype).")
        z = self.moe_z_loss_coeff
        if z is not None and z < 0:
            out.append(f"{at}moe_z_loss_coeff={z!r} must be >= 0 (or null: off).")
        return out


@dataclass
class ParallelConfig(Checked):
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    recompute: Optional[Recompute] = None
    # MoE models (Qwen3-MoE, Mixtral): experts split over this many ranks (EP x TP x PP x DP; divides the
    # data-parallel x tensor-parallel ranks and the expert count)
    expert_model_parallel_size: int = 1
    # context parallelism: each rank holds 1/cp of every sequence (megatron's load-balanced split; GPU with
    # Transformer Engine only); dp = world / (tp * cp * pp)
    context_parallel_size: int = 1
    # uneven pipelines (e.g. 30 layers at PP4: 6 + 8 + 8 + 8): layers of the first / last stage, the rest
    # split evenly over the middle stages; null = an even split
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    # count the embedding / the loss as one layer each when splitting the layers over the stages (the first /
    # last stage then holds one transformer layer less); not with num_layers_in_first/last_pipeline_stage
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    def problems(self, at: str = "") -> list[str]:
        out = ge(self, at, "tensor_model_parallel_size pipeline_model_parallel_size expert_model_parallel_size "
                           "context_parallel_size", 1)
        out += ge_or_null(self, at, "num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage",
                          "null splits the layers evenly")
        if (self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split) and (
                self.num_layers_in_first_pipeline_stage is not None or self.num_layers_in_last_pipeline_stage is not None):
            out.append(f"{at}account_for_embedding/loss_in_pipeline_split cannot be combined with "
                       f"{at}num_layers_in_first/last_pipeline_stage (megatron-core refuses both); set one of them.")
        vpp, pp = self.virtual_pipeline_model_parallel_size, self.pipeline_model_parallel_size
        if vpp is not None and (vpp < 1 or (pp or 1) < 2):
            out.append(f"{at}virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 "
                       f"(got {pp}) and a value >= 1; set it to null.")
        return out
