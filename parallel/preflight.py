"""Early model checks from `config.json` alone, before any weight is downloaded or allocated.

`check_model(path_or_name, tp=..., pp=..., ep=...)` reads only the HF config (a local directory,
or a hub name from which only ``config.json`` is fetched), then checks the architecture (converter
registry), the rope type and the parallel layout exactly as the model build will.  Call it at
`--cfg` / start; it raises `UnsupportedModelError` (architecture, rope, activation; the message
names what is supported) or `ValueError` (layout; the message names the bad value and the fix).
"""
from __future__ import annotations

import os

from parallel.convert.registry import supported_architectures
from parallel.convert.spec import HFModelSpec, UnsupportedModelError
from parallel.model_config import hf_model_spec, validate_parallel_layout


def load_hf_config(path_or_name: str):
    """The `transformers` config of a local HF directory or a hub name, reading only config.json.

    Raises FileNotFoundError for a directory without config.json, UnsupportedModelError for a
    `model_type` transformers does not know (with our supported list).
    """
    from transformers import AutoConfig

    if os.path.isdir(path_or_name):
        if not os.path.isfile(os.path.join(path_or_name, "config.json")):
            raise FileNotFoundError(f"{path_or_name!r} has no config.json; is it a Hugging Face model directory?")
        config_dir = path_or_name
    else:
        from huggingface_hub import hf_hub_download

        config_dir = os.path.dirname(hf_hub_download(path_or_name, "config.json"))
    try:
        return AutoConfig.from_pretrained(config_dir)
    except (KeyError, ValueError) as e:
        raise UnsupportedModelError(f"cannot read the config of {path_or_name!r} ({e}); supported architectures: "
                                    f"{', '.join(supported_architectures())}") from e


def check_model(path_or_name: str, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1,
                num_layers_in_first_pipeline_stage: int | None = None,
                num_layers_in_last_pipeline_stage: int | None = None,
                account_for_embedding_in_pipeline_split: bool = False,
                account_for_loss_in_pipeline_split: bool = False) -> HFModelSpec:
    """Check that the model can be built at this layout, from its config alone; returns its spec.

    Raises UnsupportedModelError (architecture / rope type / activation, naming the supported
    ones) or ValueError (tp/pp/vpp/ep or uneven-stage sizes that do not shard the model).
    """
    spec = hf_model_spec(load_hf_config(path_or_name))
    validate_parallel_layout(spec, tp, pp, vpp, num_layers_in_first_pipeline_stage,
                             num_layers_in_last_pipeline_stage, ep=ep,
                             account_for_embedding_in_pipeline_split=account_for_embedding_in_pipeline_split,
                             account_for_loss_in_pipeline_split=account_for_loss_in_pipeline_split)
    return spec


#: the module megatron-core's flex dispatcher imports its DeepEP kernels from (transformer/moe/fused_a2a.py)
DEEP_EP_MODULE = "deep_ep"


def check_token_dispatcher(dispatcher_type: str, enable_deepep: bool, device: str,
                           keys: tuple[str, str] = ("model.moe_token_dispatcher_type", "model.moe_enable_deepep"),
                           deep_ep_module: str = DEEP_EP_MODULE) -> list[str]:
    """Why the MoE token dispatcher cannot run on ``device`` (``"cuda"``, ``"cpu"``, ...): [] for alltoall, else one
    line naming `keys` (the dispatcher's and DeepEP's) and the fix.  megatron-core 0.16.1's flex dispatcher
    (transformer/moe/token_dispatcher.py, _DeepepManager) runs DeepEP's CUDA kernels, imported from the
    ``deep_ep`` package (transformer/moe/fused_a2a.py: ``from deep_ep import Buffer``); without it megatron raises
    ImportError only when the model is built.  Call before any model is built."""
    if dispatcher_type != "flex" and not enable_deepep:
        return []
    what = f"{keys[0]}={dispatcher_type}" + (f" with {keys[1]}=true" if enable_deepep else "")
    fix = (f"install DeepEP (https://github.com/deepseek-ai/DeepEP, the '{deep_ep_module}' package) on the GPU "
           f"nodes, or drop {keys[1]} and set {keys[0]}=alltoall")
    if device != "cuda":
        return [f"{what} runs DeepEP's fused all-to-all, CUDA kernels only, but this run's device is {device}: {fix}."]
    import importlib.util

    if importlib.util.find_spec(deep_ep_module) is None:
        return [f"{what} runs DeepEP's fused all-to-all, but the '{deep_ep_module}' package is not importable here: "
                f"{fix}."]
    return []
