"""The checks of on-policy distillation (``distill.*``, rlhf.algorithms.distill) that cross sections or need files:
the trainer it runs in, and that the teacher shares the student's tokenizer (it scores the student's token ids).  The
tokenizer check runs at ``--cfg`` / the start of a run from the files when both are on disk (:func:`files_vocab`),
and on the trainer ranks on the loaded tokenizers before any model is built (rlhf.workers.teacher).  The config.json
``vocab_size`` (embedding rows) may differ: a family pads its embedding per size over one tokenizer.  No torch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional


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
    """The token -> id map of the tokenizer saved in `model_dir` (tokenizer.json, read by HF ``tokenizers``, added
    tokens included; else vocab.json plus added_tokens.json), or None when there is none readable."""
    d = Path(model_dir or "")
    try:
        if model_dir and (d / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab(with_added_tokens=True)
        if model_dir and (d / "vocab.json").is_file():
            extra = d / "added_tokens.json"
            return {**json.loads((d / "vocab.json").read_text(encoding="utf-8")),
                    **(json.loads(extra.read_text(encoding="utf-8")) if extra.is_file() else {})}
    except Exception:  # noqa: BLE001 - unreadable (tokenizers raises its own Exception type): no check from files
        return None
    return None


def tokenizer_dir(cfg: Any, path: Optional[str]) -> Optional[str]:
    """The local directory of model reference `path`'s tokenizer (a local directory, a built tiny:// model, a hub
    model's snapshot in the local cache), without building or downloading; else None."""
    if not path:
        return None
    from rlhf.data.refs import cached_hub_file, parse_model_ref
    from rlhf.quickstart.resolve import local_model_path

    if local := local_model_path(cfg, path):
        return local
    ref = parse_model_ref(path)
    found = ref.kind == "hub" and (cached_hub_file(ref.path, "tokenizer.json") or cached_hub_file(ref.path,
                                                                                                  "vocab.json"))
    return str(found.parent) if found else None


def distill_problems(cfg: Any, check_files: bool = False, world_size: Optional[int] = None) -> list[str]:
    """Problems of ``distill`` with the rest of the config: only the PPO-family trainer distils; the teacher's own
    grid (``distill.teacher.tensor/pipeline_model_parallel_size``) divides the `world_size` trainer ranks (when known)
    and its data-parallel size the batch; with `check_files` the teacher's tokenizer against the student's
    (``model.tokenizer_path``, else ``model.path``) when both are on disk.  One line each (key, value, why, fix)."""
    d, out = cfg.get("distill"), []
    if d is None or not d.enable:
        return []
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
