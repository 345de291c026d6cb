"""A trainer rank's mapping of an engine's shared parameters (shared_params.map_arena) writes into the engine's
parameters and can be released after the engine and its torch_shm_manager are gone: SGLang's shutdown kills the
manager with the engine's process tree, and a rank closing after that used to abort ("Broken pipe" thrown in a C++
destructor, SIGABRT; tests/e2e/test_model_families_ppo.py's PP2 run, rank 1, now and then)."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp
    import psutil
    import torch
    from rlhf.rollout import engine_loader
    from rlhf.weight_bridge.shared_params import map_arena

    def engine(q, written, done):
        model = torch.nn.Linear(3, 2)
        share = engine_loader.share_parameters(model, dict(model.named_parameters()))
        q.put((share["handle"], share["size"], share["offsets"]["weight"]))
        written.wait()
        print("engine weight", model.weight.detach().flatten().tolist(), flush=True)
        for child in psutil.Process().children(recursive=True):  # as SGLang's kill_process_tree does
            print("killed", child.name(), flush=True)
            child.kill()
        done.set()

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q, written, done = ctx.Queue(), ctx.Event(), ctx.Event()
        p = ctx.Process(target=engine, args=(q, written, done))
        p.start()
        handle, size, offset = q.get(timeout=120)
        arena = map_arena(handle, size)
        arena[offset:offset + 24].view(torch.float32).copy_(torch.arange(6, dtype=torch.float32))
        written.set()
        done.wait(timeout=120)
        p.join(timeout=120)
        del arena  # released after the engine's shared-memory manager died
        print("released", flush=True)
""")


def test_mapping_writes_the_engine_parameter_and_outlives_its_shm_manager(tmp_path):
    script = tmp_path / "arena.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "engine weight [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]" in out and "killed torch_shm_manager" in out, out
    assert "released" in out, out


def test_layers_that_repack_weights_at_a_sessions_begin_are_not_shared():
    """The trainer ranks write before the commit's session opens, so SGLang's restore_weights_before_loading would
    run on the new weights: a layer whose quantization method repacks there is refused (nothing shared; the sync
    loads buckets), SGLang's unquantized methods (their restore acts only for a GPU MoE backend) are shared."""
    import pytest
    import torch
    from sglang.srt.layers.quantization.base_config import QuantizeMethodBase
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod, UnquantizedLinearMethod

    from rlhf.rollout import engine_loader

    class Repacking(QuantizeMethodBase):
        def create_weights(self, *args, **kwargs):
            pass

        def apply(self, *args, **kwargs):
            pass

        def restore_weights_before_loading(self, layer):
            pass

    def model_with(method):
        model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        model[0].__dict__["quant_method"] = method  # as an attribute only (the MoE method is an nn.Module too)
        return model

    fused_moe = object.__new__(UnquantizedFusedMoEMethod)  # its restore is overridden (unbuilt: only its type counts)
    for method in (UnquantizedLinearMethod(), fused_moe):
        model = model_with(method)
        assert engine_loader.share_parameters(model, dict(model.named_parameters()))["size"] > 0
    model = model_with(Repacking())
    with pytest.raises(ValueError, match=r"quantization method\(s\) \['Repacking'\] repack weights in place"):
        engine_loader.share_parameters(model, dict(model.named_parameters()))
