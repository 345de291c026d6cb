"""Small megatron-core dist checkpoints written without megatron or a process group (torch.distributed.checkpoint's
single-process save, plus megatron's ``metadata.json``): real ``torch_dist`` checkpoints whose tensor names and
global shapes are given by the test, for the ``--cfg`` checks of parallel.init_checkpoint."""
from __future__ import annotations

import json
import os

import torch

#: megatron-core's metadata.json of a torch_dist checkpoint
METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}


def write_dcp(path, shapes: dict[str, tuple]) -> str:
    """A dist checkpoint at `path` holding zero tensors of `shapes` ({megatron name: global shape}); returns it."""
    import torch.distributed.checkpoint as dcp

    os.makedirs(path, exist_ok=True)
    dcp.save({k: torch.zeros(s) for k, s in shapes.items()}, checkpoint_id=str(path), no_dist=True)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(METADATA, f)
    return str(path)


def llama_shapes(vocab_rows: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int) -> dict:
    """Megatron names and global shapes of an untied Llama as megatron-core saves it, written out by hand: the
    embedding and LM head [vocab_rows, hidden]; the layers (all of one kind) stacked as ``decoder.layers.<name>``
    with a leading [layers] dim: the norms (named as Transformer Engine's fused ones, megatron's local spec maps
    them so) [hidden], linear_qkv [(heads + 2 kv_heads) * head_dim, hidden], linear_proj [hidden, heads *
    head_dim], linear_fc1 [2 ffn, hidden] (gate; up), linear_fc2 [hidden, ffn]."""
    d, p = hidden // heads, "decoder.layers."
    return {"embedding.word_embeddings.weight": (vocab_rows, hidden), "decoder.final_layernorm.weight": (hidden,),
            "output_layer.weight": (vocab_rows, hidden),
            p + "self_attention.linear_qkv.layer_norm_weight": (layers, hidden),
            p + "self_attention.linear_qkv.weight": (layers, (heads + 2 * kv_heads) * d, hidden),
            p + "self_attention.linear_proj.weight": (layers, hidden, heads * d),
            p + "mlp.linear_fc1.layer_norm_weight": (layers, hidden),
            p + "mlp.linear_fc1.weight": (layers, 2 * ffn, hidden), p + "mlp.linear_fc2.weight": (layers, hidden, ffn)}
