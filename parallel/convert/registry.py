"""The converter registry: HF `architectures[0]` -> its `ModelFamily` (one file per family).

To add a family: write `parallel/convert/<family>.py` with a `FAMILY = ModelFamily(...)` (its
architectures and ONE megatron <-> HF name map) and list it in `FAMILIES` below.  Everything
else (import, export, weight sync, early config checks, the supported list in errors) finds it
here.  Re-exported by `parallel.convert`.
"""
from __future__ import annotations

from parallel.convert import deepseek_v3, llama, mixtral, qwen3
from parallel.convert.family import ModelFamily
from parallel.convert.spec import UnsupportedModelError

FAMILIES: tuple[ModelFamily, ...] = (llama.FAMILY, qwen3.FAMILY, mixtral.FAMILY, deepseek_v3.FAMILY)

CONVERTERS: dict[str, ModelFamily] = {arch: fam for fam in FAMILIES for arch in fam.architectures}
"""HF architecture name -> ModelFamily."""

_BY_MODEL_TYPE = {mt: arch for fam in FAMILIES for mt, arch in fam.model_types.items()}


def supported_architectures() -> tuple[str, ...]:
    """Every HF architecture name the registry converts, in registration order."""
    return tuple(CONVERTERS)


def get_converter(architecture: str) -> ModelFamily:
    """The ModelFamily for a HF architecture name; UnsupportedModelError naming the supported list."""
    if architecture not in CONVERTERS:
        raise UnsupportedModelError(f"unsupported architecture {architecture!r}; supported: "
                                    f"{', '.join(supported_architectures())}")
    return CONVERTERS[architecture]


def resolve_architecture(hf_config) -> str:
    """The supported architecture of a `transformers.PretrainedConfig` (from `architectures`, else
    from `model_type`).  Raises UnsupportedModelError naming what the config declares and the
    supported list."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        mt = _BY_MODEL_TYPE.get(getattr(hf_config, "model_type", ""))
        archs = [mt] if mt else []
    arch = next((a for a in archs if a in CONVERTERS), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs or getattr(hf_config, 'model_type', None)!r}; "
            f"supported: {', '.join(supported_architectures())}")
    return arch
