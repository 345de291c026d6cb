"""The checks of on-policy distillation (``distill.*``, rlhf.algorithms.distill) that cross sections or need files:
the trainer it runs in, and that the teacher shares the student's tokenizer (the teacher scores the student's token
ids, so both must map every token to the same id).  No torch.

The tokenizer check runs twice: at ``--cfg`` / the start of a run from the files when both tokenizers are on disk
(:func:`files_vocab`: tokenizer.json, else vocab.json + added_tokens.json), and on the trainer ranks on the loaded
tokenizers before any model is built (rlhf.workers.teacher).  The config.json ``vocab_size`` (embedding rows) may
differ: a family pads its embedding differently per size (Qwen2.5-0.5B 151936, Qwen2.5-7B 152064) over one
tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

__all__ = ["vocab_mismatch", "files_vocab", "distill_problems", "tokenizer_dir", "teacher_layout"]


def vocab_mismatch(student: Mapping[str, int], teacher: Mapping[str, int]) -> Optional[str]:
    """Why the teacher's token -> id map `teacher` cannot score the student's (`student`), or None when they are equal.
    Names the sizes and up to three tokens that differ (missing in the teacher, or another id)."""
    if dict(student) == dict(teacher):
        return None
    differ = [t for t, i in student.items() if teacher.get(t) != i]
    extra = [t for t in teacher if t not in student]
    shown = ", ".join(f"{t!r}: {student[t]} vs {teacher.get(t, 'missing')}" for t in differ[:3]) or \
        ", ".join(f"{t!r} (teacher only)" for t in extra[:3])
    return (f"the teacher's tokenizer is not the student's ({len(student)} tokens vs {len(teacher)}; "
            f"{len(differ)} of the student's tokens have another id or none in the teacher's, e.g. {shown})")


def files_vocab(model_dir: Optional[str]) -> Optional[dict]:
    """The token -> id map of the tokenizer saved in `model_dir` (tokenizer.json: its model's vocab plus the added
    tokens; else vocab.json plus added_tokens.json), or None when there is none readable (sentencepiece only, no
    directory)."""
    if not model_dir or not Path(model_dir).is_dir():
        return None
    d = Path(model_dir)
    try:
        if (d / "tokenizer.json").is_file():
            tok = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
            vocab = tok.get("model", {}).get("vocab")
            if isinstance(vocab, list):  # Unigram: [[piece, score], ...] in id order
                vocab = {piece[0]: i for i, piece in enumerate(vocab)}
            if not isinstance(vocab, dict):
                return None
            out = dict(vocab)
            out.update({a["content"]: a["id"] for a in tok.get("added_tokens") or []})
            return out
        if (d / "vocab.json").is_file():
            out = json.loads((d / "vocab.json").read_text(encoding="utf-8"))
            if (d / "added_tokens.json").is_file():
                out.update(json.loads((d / "added_tokens.json").read_text(encoding="utf-8")))
            return out
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None


def tokenizer_dir(cfg: Any, path: Optional[str]) -> Optional[str]:
    """The local directory holding the tokenizer of model reference `path` without building or downloading: a
    local directory, a built tiny:// model, a hub model's snapshot in the local cache; else None."""
    if not path:
        return None
    from rlhf.data.refs import cached_hub_file, parse_model_ref
    from rlhf.quickstart.resolve import local_model_path

    local = local_model_path(cfg, path)
    if local:
        return local
    ref = parse_model_ref(path)
    if ref.kind == "hub":
        found = cached_hub_file(ref.path, "tokenizer.json") or cached_hub_file(ref.path, "vocab.json")
        return str(found.parent) if found else None
    return None


def distill_problems(cfg: Any, check_files: bool = False, world_size: Optional[int] = None) -> list[str]:
    """Problems of ``distill`` with the rest of the config: only the PPO-family trainer distils; the teacher's own
    grid (``distill.teacher.tensor/pipeline_model_parallel_size``) divides the `world_size` trainer ranks (when known)
    and its data-parallel size the batch; with `check_files` the teacher's tokenizer against the student's
    (``model.tokenizer_path``, else ``model.path``) when both are on disk.  One line each (key, value, why, fix)."""
    d = cfg.get("distill")
    if d is None or not d.enable:
        return []
    out = []
    if str(cfg.algorithm.name) == "dpo":
        out.append("distill.enable=true with algorithm.name=dpo: on-policy distillation scores the student's own "
                   "rollouts, which the DPO trainer does not generate; use a PPO-family algorithm (e.g. "
                   "algorithm.adv_estimator=grpo), or set distill.enable=false.")
    out += _teacher_layout(cfg, world_size)
    if check_files and d.teacher.path:
        student_ref = cfg.model.tokenizer_path or cfg.model.path
        student, teacher = (files_vocab(tokenizer_dir(cfg, p)) for p in (student_ref, d.teacher.path))
        why = vocab_mismatch(student, teacher) if student is not None and teacher is not None else None
        if why:
            out.append(mismatch_message(d.teacher.path, student_ref, why))
    return out


def mismatch_message(teacher_path: str, student_ref: str, why: str) -> str:
    """The one-line refusal of a teacher whose tokenizer is not the student's."""
    return (f"distill.teacher.path={teacher_path!r}: {why}. On-policy distillation scores the student's sampled "
            f"token ids with the teacher, so both must use the same tokenizer (the student's: {student_ref!r}); pick "
            f"a teacher of the student's tokenizer family (e.g. a larger model of the same family), or set "
            f"distill.enable=false.")


def teacher_layout(cfg: Any) -> Optional[tuple[int, int]]:
    """The teacher's own (tp, pp) when ``distill.teacher.tensor/pipeline_model_parallel_size`` differ from the
    trainer's ``parallel.*`` (null: the trainer's size), else None (the teacher is sharded like the actor)."""
    t, p = cfg.distill.teacher, cfg.parallel
    tp = t.get("tensor_model_parallel_size") or p.tensor_model_parallel_size
    pp = t.get("pipeline_model_parallel_size") or p.pipeline_model_parallel_size
    return None if (tp, pp) == (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) else (tp, pp)


def _teacher_layout(cfg: Any, world_size: Optional[int]) -> list[str]:
    layout = teacher_layout(cfg)
    if layout is None or world_size is None or min(layout) < 1:
        return []  # the fields' own rules report a size below 1
    tp, pp = layout
    keys = (f"distill.teacher.tensor_model_parallel_size={tp} x distill.teacher.pipeline_model_parallel_size={pp}"
            " (null: the parallel.* size)")
    if world_size % (tp * pp):
        return [f"{keys} = {tp * pp} does not divide the {world_size} trainer ranks the teacher runs on; choose "
                f"sizes whose product divides {world_size}, or null for the trainer's."]
    dp, n = world_size // (tp * pp), cfg.data.train_batch_size * cfg.rollout.n
    if n % dp:
        return [f"{keys}: the teacher's data-parallel size {dp} does not divide the batch of data.train_batch_size x "
                f"rollout.n = {n} sequences it scores; make that a multiple of {dp} or change the teacher's sizes."]
    return []
