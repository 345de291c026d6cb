"""Initial weights from a megatron-core ``dist_checkpointing`` checkpoint instead of Hugging Face safetensors
(verl's ``<role>.megatron.use_dist_checkpointing`` / ``dist_checkpointing_path``).

The checkpoint is what ``scripts/convert_checkpoint.py hf-to-mcore`` writes (:func:`write_model_checkpoint`) or a
role directory of a trainer checkpoint (``<run>/checkpoints/global_step_<k>/actor``); it loads at any TP / PP /
EP layout (dist_checkpointing reshards).  The model is still described by the HF ``config.json``.

* :func:`read_model_shapes` / :func:`check_model_checkpoint`: from the checkpoint's metadata only (no tensor
  data, no megatron import, no process group): a dist checkpoint, with model tensors, whose names and shapes are
  those of the model ``config.json`` describes (the model family's name map, shapes from :class:`HFModelSpec`).
* :func:`vocab_multiple`: the ``make_vocab_size_divisible_by`` that rebuilds the checkpoint's padded vocabulary
  at another TP size (megatron pads the vocabulary to a multiple of ``divisible_by * tp`` rows).
* :func:`load_model_weights` (collective): the model tensors into a role's chunks; the critic keeps its freshly
  initialised value head (the checkpoint's ``output_layer`` is the LM head).
"""
from __future__ import annotations

import json
import os
import re

__all__ = ["MODEL_PREFIXES", "read_model_shapes", "expected_layer_shapes", "check_model_checkpoint",
           "vocab_multiple", "load_model_weights", "write_model_checkpoint"]

#: the top-level module names of GPTModel's tensors in a dist checkpoint (everything else: optimizer, RNG, ...)
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# layers of one kind (every layer dense, or every layer MoE) are saved stacked: decoder.layers.<name>, [L, ...]
_STACKED_LAYERS = re.compile(r"^decoder\.layers\.(\D.*)$")
# megatron's expert tensors in a dist checkpoint: stacked over the routed experts, [E, *one expert's shape]
_STACKED_EXPERTS = re.compile(r"^mlp\.experts\.experts\.(linear_fc[12])\.(weight|bias)$")
_MAX_LINES = 6


def _expand(path: str) -> str:
    return os.path.abspath(os.path.expanduser(str(path)))


def read_model_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The model tensors of dist checkpoint `path` and their global (unsharded) shapes, from its metadata.

    Raises FileNotFoundError (no such directory) and ValueError (not a megatron-core dist checkpoint: the message
    says what it is instead and how to write one)."""
    path = _expand(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} does not exist")
    meta = os.path.join(path, "metadata.json")
    if not os.path.isfile(meta):
        roles = [r for r in ("actor", "critic") if os.path.isfile(os.path.join(path, r, "metadata.json"))]
        if roles:
            raise ValueError(f"{path} is a trainer checkpoint; give its {' or '.join(roles)} directory "
                             f"({os.path.join(path, roles[0])})")
        raise ValueError(f"{path} is not a megatron-core dist checkpoint (no metadata.json); write one with "
                         f"scripts/convert_checkpoint.py hf-to-mcore --hf-path <HF model> --out {path}")
    with open(meta, encoding="utf-8") as f:
        backend = json.load(f).get("sharded_backend")
    if backend != "torch_dist":
        raise ValueError(f"{path} holds a {backend!r} dist checkpoint; only megatron-core's torch_dist format "
                         f"is read (re-save it with megatron-core >= 0.8, or convert the HF model)")
    from torch.distributed.checkpoint import FileSystemReader

    entries = FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: tuple(v.size) for k, v in entries.items()
            if k.startswith(MODEL_PREFIXES) and "_extra_state" not in k and hasattr(v, "size")}


def expected_layer_shapes(spec, moe: bool) -> dict[str, tuple[int, ...]]:
    """Global shapes of one transformer layer's tensors, by their name in the layer (the model family's
    ``layer_map`` names: local-spec and Transformer Engine spellings; routed experts as one expert's shape)."""
    H, heads = spec.hidden_size, spec.num_attention_heads
    out = {n: (H,) for n in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight",
                             "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")}
    if spec.multi_latent_attention:
        m = spec.extra["megatron"]
        q_lora, kv_lora, nope, rope, v = (m["q_lora_rank"], m["kv_lora_rank"], m["qk_head_dim"],
                                          m["qk_pos_emb_head_dim"], m["v_head_dim"])
        out["self_attention.linear_kv_down_proj.weight"] = (kv_lora + rope, H)
        out["self_attention.linear_kv_up_proj.weight"] = (heads * (nope + v), kv_lora)
        for n in ("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight"):
            out[n] = (kv_lora,)
        if q_lora:
            out["self_attention.linear_q_down_proj.weight"] = (q_lora, H)
            out["self_attention.linear_q_up_proj.weight"] = (heads * (nope + rope), q_lora)
            for n in ("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight"):
                out[n] = (q_lora,)
        else:
            out["self_attention.linear_q_proj.weight"] = (heads * (nope + rope), H)
        out["self_attention.linear_proj.weight"] = (H, heads * v)
    else:
        d, groups = spec.head_dim, spec.num_query_groups
        out["self_attention.linear_qkv.weight"] = ((heads + 2 * groups) * d, H)
        out["self_attention.linear_qkv.bias"] = ((heads + 2 * groups) * d,)
        out["self_attention.q_layernorm.weight"] = out["self_attention.k_layernorm.weight"] = (d,)
        out["self_attention.linear_proj.weight"] = (H, heads * d)
    if not moe:
        out["mlp.linear_fc1.weight"] = (2 * spec.ffn_hidden_size, H)
        out["mlp.linear_fc2.weight"] = (H, spec.ffn_hidden_size)
        return out
    E, f, shared = spec.num_experts, spec.moe_ffn_hidden_size, spec.moe_shared_ffn_hidden_size
    out.update({"mlp.router.weight": (E, H), "mlp.router.expert_bias": (E,),
                "mlp.experts.{expert}.linear_fc1.weight": (2 * f, H),
                "mlp.experts.{expert}.linear_fc2.weight": (H, f)})
    if shared:
        out["mlp.shared_experts.linear_fc1.weight"] = (2 * shared, H)
        out["mlp.shared_experts.linear_fc2.weight"] = (H, shared)
    return out


def _required(spec, moe: bool) -> list[str]:
    """Layer tensors every layer of this model has (one spelling each)."""
    attn = ["self_attention.linear_proj.weight"] + (
        ["self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.weight"]
        if spec.multi_latent_attention else ["self_attention.linear_qkv.weight"])
    mlp = (["mlp.router.weight", "mlp.experts.{expert}.linear_fc1.weight", "mlp.experts.{expert}.linear_fc2.weight"]
           if moe else ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"])
    return attn + mlp


def _layer_problems(spec, family, layers: dict[int, dict[str, tuple]]) -> list[str]:
    out, foreign = [], []
    for i in range(spec.num_layers):
        moe = spec.is_moe and i >= spec.moe_dense_layers
        expected, have = expected_layer_shapes(spec, moe), layers.get(i, {})
        for name, shape in have.items():
            m = _STACKED_EXPERTS.match(name)
            key = f"mlp.experts.{{expert}}.{m.group(1)}.{m.group(2)}" if m else name
            full = f"decoder.layers.{i}.{name}"
            if key not in family.layer_map:
                foreign.append(full)
                continue
            want = expected.get(key)
            if m and want is not None:
                want = (spec.num_experts, *want)
            if want is not None and shape != want:
                out.append(f"tensor {full} has shape {list(shape)}; config.json gives {list(want)}")
        stacked = {f"mlp.experts.{{expert}}.{m.group(1)}.{m.group(2)}" for m in map(_STACKED_EXPERTS.match, have) if m}
        lacking = [n for n in _required(spec, moe) if n not in have and n not in stacked]
        if lacking and i in layers:
            out.append(f"layer {i} lacks {', '.join(lacking)} (a {'MoE' if moe else 'dense'} layer in config.json)")
    if foreign:
        out.insert(0, f"it holds {len(foreign)} tensors a {spec.architecture} (config.json) does not have, e.g. "
                      f"{', '.join(foreign[:2])}: a checkpoint of another architecture")
    return out


def check_model_checkpoint(path: str, hf_config=None, *, role: str = "actor", tp: int = 1) -> list[str]:
    """Problems (one line each, empty when fine) of dist checkpoint `path` as the initial weights of `role`.

    Without `hf_config` only the format is checked; with it, the checkpoint must hold that model: every layer
    (``num_hidden_layers``), tensors of its family only, the shapes its config gives, a vocabulary of at least
    ``vocab_size`` rows that splits over `tp`, and the LM head when the embeddings are untied (not for the
    critic, whose value head is new).  Reads metadata only."""
    try:
        shapes = read_model_shapes(path)
    except (FileNotFoundError, ValueError) as e:
        return [str(e)]
    if not shapes:
        return [f"{_expand(path)} holds no model tensors (embedding.*, decoder.*)"]
    if hf_config is None:
        return []
    from parallel.convert import get_converter
    from parallel.model_config import hf_model_spec

    spec = hf_model_spec(hf_config)
    H, out = spec.hidden_size, []
    vocab = shapes.get("embedding.word_embeddings.weight")
    if vocab is None:
        out.append("it lacks embedding.word_embeddings.weight (the model's embedding)")
    elif vocab[1] != H or vocab[0] < spec.vocab_size:
        out.append(f"embedding.word_embeddings.weight has shape {list(vocab)}; config.json gives "
                   f"[>= {spec.vocab_size}, {H}] (vocab_size, hidden_size)")
    elif vocab[0] % tp:
        out.append(f"its vocabulary of {vocab[0]} rows (padded) does not split over tensor parallel size {tp}; "
                   f"convert it again at a TP size that is a multiple of {tp}")
    layers: dict[int, dict] = {}
    for k, shape in shapes.items():
        m, stacked = _LAYER.match(k), _STACKED_LAYERS.match(k)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = shape
        elif stacked:
            for i in range(shape[0]):
                layers.setdefault(i, {})[stacked.group(1)] = shape[1:]
    if sorted(layers) != list(range(spec.num_layers)):
        out.append(f"it holds layers {_ranges(sorted(layers))}; config.json gives num_hidden_layers="
                   f"{spec.num_layers}")
    out += _layer_problems(spec, get_converter(spec.architecture), layers)
    norm = shapes.get("decoder.final_layernorm.weight")
    if norm is not None and norm != (H,):
        out.append(f"decoder.final_layernorm.weight has shape {list(norm)}; config.json gives [{H}]")
    head = shapes.get("output_layer.weight")
    if role != "critic" and not spec.tie_word_embeddings and head is None:
        out.append("it lacks output_layer.weight (config.json: tie_word_embeddings=false)")
    elif role != "critic" and head is not None and vocab is not None and head != vocab:
        out.append(f"output_layer.weight has shape {list(head)}; the embedding {list(vocab)}")
    if len(out) > _MAX_LINES:
        out = out[:_MAX_LINES] + [f"... and {len(out) - _MAX_LINES} more differences from config.json"]
    return out


def _ranges(ids: list[int]) -> str:
    if not ids:
        return "none"
    return f"{ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else str(ids)


def vocab_multiple(path: str, tp: int) -> int:
    """``make_vocab_size_divisible_by`` giving the checkpoint's padded vocabulary (its embedding rows) at tensor
    parallel size `tp`: megatron pads to a multiple of ``divisible_by * tp``, so rows // tp (rows >= vocab_size).
    Raises ValueError when the rows do not split over `tp`, FileNotFoundError / ValueError as
    :func:`read_model_shapes`."""
    rows = read_model_shapes(path).get("embedding.word_embeddings.weight", (0,))[0]
    if not rows or rows % tp:
        raise ValueError(f"{_expand(path)}: embedding rows {rows} do not split over tensor parallel size {tp}")
    return rows // tp


def load_model_weights(path: str, chunks, *, role: str = "actor") -> None:
    """Collective: this rank's model tensors of `chunks` (one GPTModel per virtual stage, built for the same
    ``config.json`` with :func:`vocab_multiple`'s vocabulary) from dist checkpoint `path`, at any layout.

    The critic's ``output_layer`` (its value head) keeps its initial values.  Extra tensors in the checkpoint
    (optimizer state of a trainer checkpoint) are not read.  Raises FileNotFoundError / ValueError as
    :func:`read_model_shapes`, ValueError for a slim trainer checkpoint (frozen weights left out), RuntimeError
    naming the tensors the model needs and the checkpoint lacks."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from parallel.dist_checkpoint import FORMAT_KEY, fill_model, model_sharded_state_dict

    path = _expand(path)
    have = read_model_shapes(path)
    common = dist_checkpointing.load_common_state_dict(path)
    if (common or {}).get(FORMAT_KEY, {}).get("slim"):
        raise ValueError(f"{path} is a slim trainer checkpoint (frozen weights are not in it); give a full one")
    sd = model_sharded_state_dict(chunks)
    skipped = set()
    for part in sd.values():
        for name in [n for n in part if role == "critic" and n.startswith("output_layer.")]:
            skipped.add(name)
            del part[name]
    wanted = {getattr(v, "key", None) for part in sd.values() for v in part.values()}
    lacking = sorted(k for k in wanted if k and k.startswith(MODEL_PREFIXES) and "_extra_state" not in k
                     and k not in have)
    if lacking:
        raise RuntimeError(f"{path} lacks tensors the model needs: {lacking[:5]}{' ...' if len(lacking) > 5 else ''}"
                           f" (was it written for another config.json, or with the other layer spec: Transformer "
                           f"Engine vs megatron's local spec?)")
    try:
        loaded = dist_checkpointing.load(sd, path)
    except CheckpointingException as e:
        raise RuntimeError(f"loading the initial weights from {path}: {e}") from e
    fill_model(chunks, loaded, path, skipped)


def write_model_checkpoint(hf_path: str, out: str, chunks) -> None:
    """Collective: `chunks` (built from the HF model at `hf_path`) as a dist checkpoint at `out`, with the HF
    config / tokenizer files in ``out/hf`` (so the way back needs nothing else); written to ``out.tmp`` and
    renamed (an interrupted write leaves no partial `out`).  What ``convert_checkpoint.py hf-to-mcore`` writes."""
    import shutil

    import torch.distributed as dist

    from parallel.dist_checkpoint import save_sharded

    tmp = out.rstrip("/") + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    save_sharded(tmp, chunks, common={"format": "rlhf-mcore-v1"})
    if dist.get_rank() == 0:
        hf_dir = os.path.join(tmp, "hf")
        os.makedirs(hf_dir, exist_ok=True)
        for f in os.listdir(hf_path):
            if f.endswith(".json") and "safetensors" not in f or f.startswith("tokenizer") or f.endswith(".model"):
                shutil.copy(os.path.join(hf_path, f), hf_dir)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    dist.barrier()
