"""The on-policy distillation teacher (``distill.*``, rlhf.algorithms.distill): a frozen megatron GPTModel built from
an HF checkpoint (any family parallel.convert supports, of any size the trainer's layout shards), scoring the
student's sampled tokens with the same no-grad forward as the reference (rlhf.workers.actor.MegatronActor, no
optimizer).  It is sharded like every role of the trainer (``parallel.tensor/pipeline_model_parallel_size``), or,
with ``distill.teacher.tensor_model_parallel_size`` / ``pipeline_model_parallel_size``, on a megatron grid of its
own over the same ranks (parallel.layouts): a teacher larger than the student split wider.  Collective where
noted."""
from __future__ import annotations

import logging

import torch.distributed as dist
from omegaconf import OmegaConf

from parallel.layouts import ParallelLayout
from parallel.model_config import hf_model_spec
from parallel.models import build_model_chunks
from rlhf.config.errors import ConfigValidationError
from rlhf.preflight import (mismatch_message, teacher_dispatcher_message, teacher_dispatcher_refused, teacher_layout,
                            vocab_mismatch)

from .actor import MegatronActor
from .build import attach_offload, load_hf_config, model_config_kwargs, resolve_model_path

__all__ = ["resolve_teacher", "build_teacher", "LayoutTeacher"]

logger = logging.getLogger(__name__)


def resolve_teacher(cfg, student_tokenizer):
    """Collective. ``distill.teacher.path`` as a local directory (tiny://, hub names and local directories resolved
    like the actor's) and its HF config, after checking that its tokenizer is the student's `student_tokenizer`
    (the same token -> id map: the teacher scores the student's token ids) and that its embedding holds every id.
    Call before any model is built.

    Returns:
        (path, hf_config).

    Raises:
        ConfigValidationError: the teacher has no loadable tokenizer, its tokenizer differs from the student's, or its
            vocab_size is smaller than the student's tokenizer (the run exits with code 2, naming the key).
    """
    from transformers import AutoTokenizer

    key = cfg.distill.teacher.path
    path = resolve_model_path(cfg, key)
    student_ref = cfg.model.tokenizer_path or cfg.model.path
    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigValidationError([f"distill.teacher.path={key!r} has no tokenizer that loads ({e}); the teacher "
                                     f"must share the student's tokenizer: save it there "
                                     f"(tokenizer.save_pretrained)."]) from None
    why = vocab_mismatch(student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab())
    if why:
        raise ConfigValidationError([mismatch_message(key, student_ref, why)])
    hf_config = load_hf_config(path)
    rows = getattr(getattr(hf_config, "text_config", None) or hf_config, "vocab_size", None)
    if rows is not None and rows < len(student_tokenizer):
        raise ConfigValidationError([f"distill.teacher.path={key!r}: its vocab_size={rows} (config.json) is smaller "
                                     f"than the student's tokenizer ({len(student_tokenizer)} tokens); give a teacher "
                                     f"whose embedding covers the tokenizer."])
    if dist.get_rank() == 0:
        logger.info("distill: teacher %s (%s), tokenizer shared with the student", key,
                    (getattr(hf_config, "architectures", None) or ["?"])[0])
    return path, hf_config


class LayoutTeacher(MegatronActor):
    """A teacher on a megatron grid of its own (parallel.layouts.ParallelLayout, `layout`): its forwards run with
    that grid's process groups in place (collective over them), the trainer's back after each."""

    def __init__(self, bundle, layout, section, *, temperature: float):
        super().__init__(bundle, None, section, temperature=temperature)
        self.layout = layout

    def compute_log_prob(self, batch: dict, *, calculate_entropy: bool = False) -> dict:
        """As MegatronActor.compute_log_prob ([N, R] on every rank), sliced over the teacher's data parallel."""
        with self.layout:
            return super().compute_log_prob(batch, calculate_entropy=calculate_entropy)


def build_teacher(cfg, path: str, hf_config, *, temperature: float) -> MegatronActor:
    """Collective. The frozen teacher from the HF weights at `path` (no optimizer, eval mode), computing log-probs
    with the rollout's `temperature` like the actor and the reference; micro batches of
    ``distill.teacher.log_prob_micro_batch_size_per_gpu`` (null: the actor's), parameters offloaded between its
    forwards with ``distill.teacher.param_offload``.  With ``distill.teacher.tensor/pipeline_model_parallel_size``
    other than the trainer's, the teacher lives on a grid of its own over the same ranks (a :class:`LayoutTeacher`;
    sequence parallel only at TP > 1, the student's uneven pipeline split not applied).  Raises ValueError when its
    sizes do not divide the world or the teacher's model (before any allocation), ConfigValidationError (rlhf.main:
    exit 2) for a MoE teacher on a grid of its own at TP 1 with model.moe_token_dispatcher_type=flex (megatron's flex
    dispatcher needs TP x EP > 1; rlhf.preflight.teacher_dispatcher_message)."""
    section = OmegaConf.create(OmegaConf.to_container(cfg.actor, resolve=True))
    mbs = cfg.distill.teacher.log_prob_micro_batch_size_per_gpu
    if mbs is not None:
        section.log_prob_micro_batch_size_per_gpu = mbs
    kwargs, own = model_config_kwargs(cfg), teacher_layout(cfg)
    if own is None:
        bundle = build_model_chunks(hf_config, "reference", path, **kwargs)
        teacher = MegatronActor(bundle, None, section, temperature=temperature)
    else:
        tp, pp = own
        if teacher_dispatcher_refused(cfg) and hf_model_spec(hf_config).is_moe:  # --cfg checks it from config.json
            raise ConfigValidationError([teacher_dispatcher_message(cfg)])
        kwargs.update(sequence_parallel=kwargs["sequence_parallel"] and tp > 1, num_layers_in_first_pipeline_stage=None,
                      num_layers_in_last_pipeline_stage=None, account_for_embedding_in_pipeline_split=False,
                      account_for_loss_in_pipeline_split=False)
        layout = ParallelLayout(tp, pp)
        with layout:
            bundle = build_model_chunks(hf_config, "reference", path, **kwargs)
        teacher = LayoutTeacher(bundle, layout, section, temperature=temperature)
        if dist.get_rank() == 0:
            logger.info("distill: the teacher on its own grid %s (the trainer's: tp=%d, pp=%d)", layout,
                        cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size)
    return attach_offload(teacher, ["params" if cfg.distill.teacher.param_offload else None], "teacher")
