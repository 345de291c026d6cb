"""parallel.kernels: fused kernels only when their extension imports, TE required on GPU (imports mocked)."""
import logging

import pytest

from parallel import kernels
from parallel.kernels import (ALLOW_NO_TE_ENV, C_COMPILER, FUSION_REQUIREMENTS, TE_INSTALL_COMMAND,
                                TransformerEngineMissingError, emit_warnings, kernel_metrics, select_kernels)

ALL_MODULES = {m for mods in FUSION_REQUIREMENTS.values() for m in mods} | {"transformer_engine"}


def only(*present):
    return lambda name: name in present


def test_cpu_is_unfused_local_spec_and_silent():
    choice = select_kernels(False, importable=lambda n: True)  # even with everything installed
    assert choice.use_te is False and not any(choice.fusions.values()) and choice.warnings == ()
    assert set(choice.fusions) == {"masked_softmax_fusion", "bias_activation_fusion", "apply_rope_fusion",
                                   "gradient_accumulation_fusion"}
    with pytest.raises(TransformerEngineMissingError, match="needs CUDA"):
        select_kernels(False, use_te=True)


def test_complete_gpu_install_fuses_everything_without_warning():
    choice = select_kernels(True, importable=only(*ALL_MODULES))
    assert choice.use_te and all(choice.fusions.values()) and choice.missing == {} and choice.warnings == ()
    assert kernel_metrics(choice) == {"mcore/fused_kernel_fallbacks": 0.0, "mcore/transformer_engine_missing": 0.0}


def test_gpu_without_te_is_an_error_naming_the_install_command_and_the_env_var():
    no_te = only(*(ALL_MODULES - {"transformer_engine"}))
    with pytest.raises(TransformerEngineMissingError) as e:
        select_kernels(True, importable=no_te, environ={})
    assert TE_INSTALL_COMMAND in str(e.value) and f"{ALLOW_NO_TE_ENV}=1" in str(e.value)
    with pytest.raises(TransformerEngineMissingError):  # asking for TE explicitly is never downgraded
        select_kernels(True, importable=no_te, use_te=True, allow_no_te=True)


@pytest.mark.parametrize("how", ["env", "flag"])
def test_gpu_without_te_allowed_warns_loudly_once_and_unfuses_rope(how):
    importable = only("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda",
                      "triton", C_COMPILER, "fused_weight_gradient_mlp_cuda")
    kw = {"environ": {ALLOW_NO_TE_ENV: "1"}} if how == "env" else {"allow_no_te": True, "environ": {}}
    choice = select_kernels(True, importable=importable, **kw)
    assert choice.use_te is False and choice.te_missing
    assert choice.fusions == {"masked_softmax_fusion": True, "bias_activation_fusion": True, "apply_rope_fusion": False,
                              "gradient_accumulation_fusion": True}
    assert choice.missing == {"apply_rope_fusion": ("transformer_engine",)}
    te_warning = [w for w in choice.warnings if "Transformer Engine is NOT installed" in w]
    assert len(te_warning) == 1 and TE_INSTALL_COMMAND in te_warning[0]
    assert kernel_metrics(choice) == {"mcore/fused_kernel_fallbacks": 1.0, "mcore/transformer_engine_missing": 1.0}


def test_explicit_local_spec_on_gpu_needs_no_te():
    choice = select_kernels(True, importable=only("triton", C_COMPILER), use_te=False, environ={})
    assert choice.use_te is False and not choice.te_missing and choice.fusions["bias_activation_fusion"]


def test_missing_extensions_fall_back_with_one_warning_listing_them(caplog, monkeypatch):
    """TE present, Apex's kernels and megatron's softmax kernels absent: those two fusions are off, named in
    ONE warning, which is logged once however often the choice is resolved."""
    monkeypatch.setattr(kernels, "_WARNED", set())
    choice = select_kernels(True, importable=only("transformer_engine", "triton", C_COMPILER))
    assert choice.use_te and choice.fusions == {"masked_softmax_fusion": False, "bias_activation_fusion": True,
                                                "apply_rope_fusion": True, "gradient_accumulation_fusion": False}
    assert len(choice.warnings) == 1
    assert "masked_softmax_fusion" in choice.warnings[0] and "fused_weight_gradient_mlp_cuda" in choice.warnings[0]
    with caplog.at_level(logging.WARNING, logger="parallel.kernels"):
        assert emit_warnings(choice) == 1
        assert emit_warnings(choice) == 0
    assert len([r for r in caplog.records if "unfused torch path" in r.message]) == 1
    assert kernel_metrics(choice)["mcore/fused_kernel_fallbacks"] == 2.0


def test_flags_are_transformer_config_fields_and_off_on_this_cpu():
    """The decision's keys are real TransformerConfig fields, and the CPU build gets them all off."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(FUSION_REQUIREMENTS) <= fields
    from transformers import LlamaConfig

    from parallel.model_config import transformer_config_from_hf

    hf = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)
    cfg = transformer_config_from_hf(hf)
    assert not any(getattr(cfg, name) for name in FUSION_REQUIREMENTS)


def test_module_available_does_not_import(monkeypatch):
    assert kernels.module_available("json") and not kernels.module_available("no_such_module_xyz")
    assert not kernels.module_available("no_such_pkg.sub")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CC", raising=False)
    assert not kernels.module_available(C_COMPILER)


def test_triton_without_a_c_compiler_keeps_swiglu_unfused():
    choice = select_kernels(True, importable=only("transformer_engine", "triton"))
    assert not choice.fusions["bias_activation_fusion"]
    assert choice.missing["bias_activation_fusion"] == (C_COMPILER,)
