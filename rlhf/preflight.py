"""The checks of a run's surroundings (not of the config itself) that :func:`rlhf.config.validate_config` runs with
``check_files`` before any model or engine is built, instead of failing minutes later on the trainer's ranks: the
data and model references (``rlhf.data.refs``: local paths exist, a model's config.json is of a supported
architecture and takes the parallel layout, hub names only against the local HF cache), the engine's context against
the model's, a megatron checkpoint to start from, the checkpoint to resume from, in-process objects, the logger
backends (packages, W&B credentials), a hub dataset that can be read neither from the cache nor from the hub, and the
prompts' lengths against the data (:mod:`rlhf.data.length_check`, whose warnings are logged once per process on rank
0); and the distillation teacher's checks before it is built (:func:`distill_problems`: its own grid against the
trainer ranks and the batch, from the config alone; a MoE teacher's flex dispatcher from its config.json, and its
tokenizer against the student's).  No network but a TCP probe of the hub, no torch.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from rlhf.data.refs import cached_hub_file, parse_data_ref, parse_model_ref

__all__ = ["SUPPORTED_ARCHITECTURES", "check_model_config", "model_context_length", "critic_on", "surroundings",
           "preflight_problems", "routing_replay_problems", "hf_config_at_hand", "model_is_moe", "hub_data_problems",
           "wandb_credentials", "hub_cached_dataset", "hub_unreachable", "vocab_mismatch", "files_vocab",
           "tokenizer_dir", "mismatch_message", "teacher_layout", "teacher_dispatcher_refused",
           "teacher_dispatcher_message", "teacher_file_problems", "distill_problems"]

#: architectures the megatron model builder maps (parallel.model_config.SUPPORTED_ARCHITECTURES, which imports
#: torch; tests/unit/config/test_config.py keeps the two equal)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM")
#: sglang/srt/utils/hf_transformers/common.py CONTEXT_LENGTH_KEYS: the config.json keys SGLang derives an engine's
#: longest context from, the first one present wins
ENGINE_CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")
#: trainer.logger backends that need a package of their own: name -> (module, pip extra of setup.py)
LOGGER_PACKAGES = {"tensorboard": ("tensorboard", None), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def check_model_config(path: str | os.PathLike, layout: dict | None = None) -> list[str]:
    """Problems of the HF model whose ``config.json`` is at ``path`` (a model directory or the file), from that file
    alone (parallel.preflight.check_model): an architecture the trainer cannot build, a RoPE scaling it does not
    implement, and with ``layout`` (tp, pp, vpp, ep, num_layers_in_first/last_pipeline_stage, ...) a parallel layout
    that does not shard the model.  One line each without the key; [] when supported or unreadable."""
    p = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    from parallel.convert.spec import UnsupportedModelError
    from parallel.preflight import check_model

    try:
        check_model(str(p.parent), **(layout or {}))
    except (UnsupportedModelError, ValueError) as e:
        return [str(e).rstrip(".")]
    return []


def model_context_length(hf: dict) -> Optional[tuple[int, str]]:
    """(tokens, the config.json key) of the longest context SGLang serves the model with, as SGLang derives it (on
    the text config of a VLM): the first of :data:`ENGINE_CONTEXT_KEYS`, times the RoPE scaling ``factor`` unless
    the scaling names its ``original_max_position_embeddings`` or is llama3's; None without such a key."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    key = next((k for k in ENGINE_CONTEXT_KEYS if isinstance(text.get(k), int)), None)
    if key is None:
        return None
    rope = text.get("rope_scaling") or {}
    factor = 1 if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3" else \
        rope.get("factor", 1)
    return int(factor * text[key]), key


def critic_on(cfg: Any) -> bool:
    """Whether the run trains a critic (critic.enable, null: with the gae estimator)."""
    return bool(cfg.critic.enable) if cfg.critic.enable is not None else cfg.algorithm.adv_estimator == "gae"


def _config_json(path: Any) -> Optional[Path]:
    """config.json of a local model directory or of a hub model already in the HF cache (no network)."""
    from rlhf.config.objects import is_object_ref

    ref = parse_model_ref(path) if path and not is_object_ref(str(path)) else None
    return None if ref is None else Path(ref.path) / "config.json" if ref.kind == "local" else (
        cached_hub_file(ref.path) if ref.kind == "hub" else None)


def surroundings(cfg: Any) -> list[str]:
    """What every validation checks outside the config: the engine's context (data.max_prompt_length +
    data.max_response_length) within the model's where its config.json is at hand, the custom reward file, and
    ``object://`` references that are not objects of this process."""
    from rlhf.config.objects import is_object_ref, unknown_objects

    out, path, p, r = [], cfg.model.path, cfg.data.max_prompt_length, cfg.data.max_response_length
    if str(path).startswith("tiny://"):
        from rlhf.quickstart.resolve import QUICKSTART_MAX_POSITION_EMBEDDINGS

        ctx, where = (QUICKSTART_MAX_POSITION_EMBEDDINGS, "max_position_embeddings"), str(path)
    else:
        try:
            file = _config_json(path)
            ctx, where = model_context_length(json.loads(file.read_text(encoding="utf-8"))), str(file)
        except (AttributeError, OSError, ValueError):
            ctx = None
    if ctx is not None and p + r > ctx[0]:
        n, key = ctx
        fix = (f"set data.max_response_length={n - p} (or lower data.max_prompt_length)" if n - p >= 1 else
               f"set data.max_prompt_length and data.max_response_length to sum to at most {n}")
        out.append(f"data.max_prompt_length={p} + data.max_response_length={r} = {p + r} exceeds the model's context "
                   f"{key}={n} ({where}): the rollout engine refuses a longer context at start-up; {fix}.")
    crf = cfg.reward.custom_reward_function
    if crf.path and not is_object_ref(crf.path) and not Path(crf.path).is_file():
        out.append(f"reward.custom_reward_function.path={crf.path!r} is not a file (relative to the working directory "
                   f"{os.getcwd()}); give the path of a .py file defining {crf.name}(data_source, solution_str, "
                   f"ground_truth, extra_info).")
    refs = [("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files),
            ("model.tokenizer_path", cfg.model.tokenizer_path), ("reward.custom_reward_function.path", crf.path)]
    return out + [f"{key}={uri!r} is not an object of this process: in-process objects (rlhf.Trainer's reward "
                  f"callables, datasets, tokenizers) exist only in the Python process that created the Trainer; run "
                  f"Trainer(...).run() there, or save the object (Dataset.to_parquet, tokenizer.save_pretrained) and "
                  f"give its path." for key, value in refs + [(f"reward.sources[{i}].path", s.path) for i, s in
                                                               enumerate(cfg.reward.sources)]
                  for uri in unknown_objects(value)]


def _model(key: str, value: Optional[str], layout: Optional[dict] = None, architecture: bool = True) -> list[str]:
    ref = parse_model_ref(value) if value else None
    if ref is None:
        return []
    if ref.kind == "invalid" or (ref.kind in ("local", "tiny") and not ref.exists):
        return [f"{key}={value!r}: {ref.why}."]
    if ref.kind == "local" and not (Path(ref.path) / "config.json").is_file():
        return [f"{key}={value!r} has no config.json; give a Hugging Face model directory (save_pretrained) or a hub "
                f"name."]
    config = _config_json(value)  # a hub model only when already downloaded: no network at start-up
    return [f"{key}={value!r}: {_layout_keys(p)}." for p in check_model_config(config, layout)] \
        if config and architecture else []


#: the layout's short names in parallel.preflight.check_model's messages -> the config keys that set them
_LAYOUT_KEYS = {"tp": "parallel.tensor_model_parallel_size", "pp": "parallel.pipeline_model_parallel_size",
                "vpp": "parallel.virtual_pipeline_model_parallel_size", "ep": "parallel.expert_model_parallel_size"}


def _layout_keys(problem: str) -> str:
    """A model-layout problem with the config key of each value (``tp=3`` -> ``parallel.tensor_model_parallel_size=3``),
    so the error names what to change (in verl's keys for a verl user: rlhf.config.verl.words)."""
    return re.sub(r"(?<![\w.])(tp|pp|vpp|ep)=(?=\d)", lambda m: f"{_LAYOUT_KEYS[m[1]]}=", problem)


def _init_weights(cfg: Any) -> list[str]:
    """A role starting from a megatron dist checkpoint: the directory holds the model of the role's config.json
    (parallel.init_checkpoint)."""
    out = []
    for role, model in [("actor", cfg.model.path)] + [("critic", cfg.model.critic_path or cfg.model.path)] * \
            critic_on(cfg):
        path, config, hf = cfg[role].dist_checkpointing_path, _config_json(model), None
        if not cfg[role].use_dist_checkpointing or not path:
            continue
        from parallel.init_checkpoint import check_model_checkpoint
        from parallel.model_config import hf_model_spec
        from parallel.preflight import load_hf_config

        try:  # unsupported or unreadable: model.path's own check says so
            hf = load_hf_config(str(config.parent)) if config and config.is_file() else None
            hf_model_spec(hf) if hf is not None else None
        except (ValueError, OSError):
            hf = None
        out += [f"{role}.dist_checkpointing_path={path!r}: {p}." for p in check_model_checkpoint(
            path, hf, role=role, tp=cfg.parallel.tensor_model_parallel_size)]
    return out


def routing_replay_problems(cfg: Any) -> list[str]:
    """MoE routing replay (``actor.router_replay.mode`` R2 / R3 or ``rollout.enable_rollout_routing_replay``) on a
    ``model.path`` without MoE layers, from its config.json; [] when replay is off, the model has MoE layers, or its
    config.json is not at hand (a hub model not downloaded) or cannot be read (model.path's own check says so).  A
    tiny model is known by its name: the dense tiny Llamas built at run time (``tiny://quickstart``, ``-init``,
    ``calc``) are refused, ``tiny://quickstart-moe`` passes.  The build refuses it too
    (rlhf.workers.build.routing_replay_on, a ConfigValidationError: exit 2), after the engines launched."""
    mode = cfg.actor.get("router_replay", {}).get("mode", "disabled")
    engines = bool(cfg.rollout.get("enable_rollout_routing_replay"))
    path = cfg.model.path
    if mode == "disabled" and not engines:
        return []
    from rlhf.quickstart.model import CALC_SCHEME, QUICKSTART_INIT_SCHEME, QUICKSTART_SCHEME

    if str(path).rstrip("/") in (QUICKSTART_SCHEME, QUICKSTART_INIT_SCHEME, CALC_SCHEME):  # kind "llama_gqa"
        return [routing_replay_message(mode, engines, path, "LlamaForCausalLM")]
    hf = hf_config_at_hand(path)
    if hf is None or model_is_moe(hf):
        return []
    return [routing_replay_message(mode, engines, path, (hf.architectures or ["?"])[0])]


def hf_config_at_hand(path: Any) -> Optional[Any]:
    """The HF config (transformers PretrainedConfig) of a model reference from its config.json, when a local
    directory or an already downloaded hub model holds one that loads; None otherwise: a tiny model (its config.json
    is made at run time), a hub model not downloaded, an unreadable file (the path's own check says so)."""
    if not path or str(path).startswith("tiny://"):
        return None
    from parallel.preflight import load_hf_config

    config = _config_json(path)
    try:
        return load_hf_config(str(config.parent)) if config and config.is_file() else None
    except (ValueError, OSError):
        return None


def model_is_moe(hf: Any) -> bool:
    """Whether the HF config `hf` has MoE layers (parallel.model_config.hf_model_spec); True for a family not
    supported here (the model's own check refuses it, and no second refusal should stand beside it)."""
    from parallel.model_config import hf_model_spec

    try:
        return hf_model_spec(hf).is_moe
    except ValueError:
        return True


def routing_replay_message(mode: str, engines: bool, path: Any, arch: str) -> str:
    """The problem line of routing replay on a model without MoE layers: the keys set and their fix."""
    what = [f"actor.router_replay.mode={mode}"] * (mode != "disabled") + \
        ["rollout.enable_rollout_routing_replay=true"] * engines
    fix = ["actor.router_replay.mode=disabled"] * (mode != "disabled") + \
        ["rollout.enable_rollout_routing_replay=false"] * engines
    return (f"{' with '.join(what)}: routing replay is for MoE models, and model.path={str(path)!r} ({arch}) has no "
            f"MoE layer; set {' and '.join(fix)}, or give a MoE model.")


def _files(cfg: Any) -> list[str]:
    """The data and model references, the megatron checkpoints to start from and the checkpoint to resume from."""
    from rlhf.config.objects import is_object_ref
    from rlhf.resume import resume_problems

    out = []
    for key in ("train_files", "val_files"):
        value = cfg.data[key]
        for i, item in enumerate([value] if isinstance(value, str) else list(value or [])):
            ref = parse_data_ref(item)
            if ref.kind == "invalid" or (ref.kind == "local" and not ref.exists):
                out.append(f"data.{key}{'' if isinstance(value, str) else f'[{i}]'}={item!r}: {ref.why}; give a local "
                           f".parquet/.jsonl file or directory, a hub dataset such as openai/gsm8k:main@train, or "
                           f"embedded://arithmetic.")
    p = cfg.parallel
    layout = dict(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                  vpp=p.virtual_pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                  **{k: p[k] for k in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                                       "account_for_embedding_in_pipeline_split",
                                       "account_for_loss_in_pipeline_split")})
    model = _model("model.path", cfg.model.path, layout)
    out += model + _init_weights(cfg) + ([] if model else routing_replay_problems(cfg))
    out += _model("model.critic_path", cfg.model.critic_path) if critic_on(cfg) else []
    d = cfg.get("distill")  # the teacher: a supported family, sharded by the trainer's layout
    out += _model("distill.teacher.path", d.teacher.path, layout) if d is not None and d.enable else []
    tok = cfg.model.tokenizer_path
    ref = parse_model_ref(tok) if tok and not is_object_ref(tok) else None
    out += [f"model.tokenizer_path={tok!r}: {ref.why}."] if ref and (ref.kind == "invalid" or (
        ref.kind == "local" and not ref.exists)) else []
    for i, src in enumerate(cfg.reward.sources):
        if src.type == "model":
            out += _model(f"reward.sources[{i}].path", src.path, architecture=False)
        elif src.type == "custom" and src.path and not is_object_ref(src.path) and not Path(src.path).is_file():
            out.append(f"reward.sources[{i}].path={src.path!r} is not a file; give a .py file defining {src.name}.")
    return out + resume_problems(cfg.trainer)


def wandb_credentials() -> bool:
    """True when W&B can log: ``WANDB_API_KEY`` set, ``WANDB_MODE`` offline/disabled/dryrun, or a netrc entry
    (``$NETRC``, default ``~/.netrc``: what ``wandb login`` writes) for the host of ``WANDB_BASE_URL``."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled",
                                                                                        "dryrun"):
        return True
    import netrc

    host = re.sub(r"^https?://", "", os.environ.get("WANDB_BASE_URL", "api.wandb.ai")).split("/")[0]
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def _loggers(cfg: Any) -> list[str]:
    """trainer.logger backends whose package is missing, and wandb without credentials while not offline."""
    import importlib.util

    out = []
    for b in map(str, cfg.trainer.logger):
        module, extra = LOGGER_PACKAGES.get(b, (None, None))
        if module and importlib.util.find_spec(module) is None:
            how = f"pip install 'rlhf-megatron-sglang[{extra}]'" if extra else f"pip install {module}"
            out.append(f"trainer.logger includes {b} but the {module} package is not installed: {how}, or drop {b}.")
    return out + (["trainer.logger includes wandb but no W&B credentials were found (no WANDB_API_KEY, no ~/.netrc "
                   "entry for api.wandb.ai, WANDB_MODE is not offline): set WANDB_MODE=offline (upload later with "
                   "`wandb sync`), or log in (`wandb login`, or WANDB_API_KEY=...), or drop wandb from trainer.logger."]
                  if "wandb" in map(str, cfg.trainer.logger) and not wandb_credentials() else [])


def hub_cached_dataset(name: str) -> Optional[Path]:
    """The local cache directory of hub dataset `name` (``datasets``' own cache or the hub's download cache), or
    None when neither has it.  Reads the filesystem only."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    owner, _, repo = name.partition("/")
    candidates = [Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser() / f"{owner}___{repo}",
                  Path(os.environ.get("HF_HUB_CACHE", os.environ.get("HUGGINGFACE_HUB_CACHE", home / "hub")))
                  .expanduser() / f"datasets--{owner}--{repo}"]
    return next((c for c in candidates if c.is_dir() and any(c.iterdir())), None)


def hub_unreachable(timeout_s: float = 3.0) -> Optional[str]:
    """Why the hub cannot be reached (``"HF_HUB_OFFLINE=1"``, ``"huggingface.co:443 is unreachable (...)"``), or
    None when a TCP connection to ``HF_ENDPOINT`` (default https://huggingface.co) opens within `timeout_s`."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]}"
    url = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host, _, port = re.sub(r"^https?://", "", url).split("/")[0].partition(":")
    port = int(port) if port.isdigit() else (80 if url.startswith("http://") else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        return f"{host}:{port} is unreachable ({e.strerror or e})"
    return None


def hub_data_problems(cfg: Any, unreachable: Optional[Callable[[], Optional[str]]] = None) -> list[str]:
    """Hub datasets of ``data.train_files`` / ``data.val_files`` that are not in the local cache while the hub cannot
    be reached (`unreachable`, default :func:`hub_unreachable`, asked once and only for such a dataset)."""
    unreachable, out, why = unreachable or hub_unreachable, [], "unasked"
    for key in ("train_files", "val_files"):
        value = cfg.data[key]
        for i, item in enumerate([value] if isinstance(value, str) else list(value or [])):
            ref = parse_data_ref(item)
            if ref.kind != "hub" or hub_cached_dataset(ref.path) is not None:
                continue
            why = unreachable() if why == "unasked" else why
            if why is None:
                return out
            at = f"data.{key}" if isinstance(value, str) else f"data.{key}[{i}]"
            out.append(f"{at}={item!r} is a hub dataset that is not in the local HF cache, and the hub cannot be "
                       f"reached ({why}): download it where there is a network (datasets.load_dataset({ref.path!r}), "
                       f"then copy ~/.cache/huggingface), or give a local .jsonl/.parquet file.")
    return out


_WARNED: set = set()  # warnings this process logged already (the checks run again for each entry point)


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


def teacher_dispatcher_refused(cfg: Any) -> bool:
    """Whether a MoE teacher on a grid of its own (:func:`teacher_layout`; expert parallel size 1 there,
    parallel.layouts) would run megatron-core's flex dispatcher at TP x EP = 1, which it refuses when the model is
    built (megatron-core 0.16.1 token_dispatcher.py MoEFlexTokenDispatcher: 'Flex token dispatcher requires TPxEP >
    1'; its TP is the expert tensor parallel size, the teacher's TP)."""
    layout = teacher_layout(cfg)
    return layout is not None and layout[0] < 2 and cfg.model.get("moe_token_dispatcher_type") == "flex"


def teacher_dispatcher_message(cfg: Any) -> str:
    """The one-line refusal of :func:`teacher_dispatcher_refused`, naming the keys and the fixes."""
    t, p = cfg.distill.teacher, cfg.parallel
    tp = t.tensor_model_parallel_size
    tp = tp if tp is not None else f"null (parallel.tensor_model_parallel_size={p.tensor_model_parallel_size})"
    return (f"model.moe_token_dispatcher_type=flex with the MoE teacher distill.teacher.path={t.path!r} on a grid of "
            f"its own (distill.teacher.tensor_model_parallel_size={tp}, distill.teacher.pipeline_model_parallel_size="
            f"{t.pipeline_model_parallel_size}): that grid has expert parallel size 1, so TP x EP = 1 there, and "
            f"megatron-core's flex dispatcher needs more than one ('Flex token dispatcher requires TPxEP > 1'); set "
            f"distill.teacher.tensor_model_parallel_size > 1, or both distill.teacher sizes to null (the teacher "
            f"sharded like the actor, with its expert parallelism), or model.moe_token_dispatcher_type=alltoall.")


def teacher_file_problems(cfg: Any) -> list[str]:
    """The distillation teacher from its files: a MoE teacher (its config.json) that megatron's flex dispatcher
    refuses on a grid of its own (:func:`teacher_dispatcher_refused`), and its tokenizer against the student's
    (``model.tokenizer_path``, else ``model.path``) when both are on disk (:func:`vocab_mismatch`)."""
    d = cfg.get("distill")
    if d is None or not d.enable or not d.teacher.path:
        return []
    hf = hf_config_at_hand(d.teacher.path) if teacher_dispatcher_refused(cfg) else None  # None: checked at build
    out = [teacher_dispatcher_message(cfg)] if hf is not None and model_is_moe(hf) else []  # a dense one has none
    student_ref = cfg.model.tokenizer_path or cfg.model.path
    student, teacher = (files_vocab(tokenizer_dir(cfg, p)) for p in (student_ref, d.teacher.path))
    why = vocab_mismatch(student, teacher) if student is not None and teacher is not None else None
    return out + ([mismatch_message(d.teacher.path, student_ref, why)] if why else [])


def _teacher_grid(cfg: Any, world_size: Optional[int]) -> list[str]:
    """The distillation teacher's own grid divides the ``world_size`` trainer ranks and its data-parallel size the
    batch (unchecked without a world size)."""
    layout = teacher_layout(cfg) if cfg.distill.enable else None
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


def distill_problems(cfg: Any, check_files: bool = False, world_size: Optional[int] = None) -> list[str]:
    """Problems of ``distill`` with the rest of the config (the DPO trainer: rules.yaml): the teacher's own grid
    against the `world_size` trainer ranks and the batch; with `check_files` the teacher's files
    (:func:`teacher_file_problems`).  One line each (key, value, why, fix)."""
    return _teacher_grid(cfg, world_size) + (teacher_file_problems(cfg) if check_files else [])


def preflight_problems(cfg: Any) -> list[str]:
    """Every problem of the surroundings that needs files (module docstring), one line each; offline hub data and
    the data's lengths only when the references were found."""
    from rlhf.data.length_check import length_report
    from rlhf.launch_env import launch_env

    out = _files(cfg)
    hub = [] if out else hub_data_problems(cfg)
    lengths, warnings = ([], []) if out or hub else length_report(cfg, hub_cached_dataset)
    for line in warnings:
        if line not in _WARNED and launch_env().rank == 0:
            _WARNED.add(line)
            logging.getLogger("rlhf.config").warning("rlhf.config: %s", line)
    return out + _loggers(cfg) + hub + lengths
