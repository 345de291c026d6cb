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
