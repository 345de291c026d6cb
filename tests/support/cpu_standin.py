"""Load one module of the CPU engine's sgl_kernel stand-in (rlhf/rollout/sglang_cpu/standin/sgl_kernel/) on its
own, without putting the stand-in package on sys.path (it would shadow the real sgl_kernel in the test process)."""
import importlib.util
import os

from rlhf.rollout import sglang_cpu


def load_standin_module(name: str):
    """The module ``sgl_kernel.<name>`` of the stand-in, imported from its file under a private name."""
    path = os.path.join(sglang_cpu.STANDIN_DIR, "sgl_kernel", name + ".py")
    spec = importlib.util.spec_from_file_location("rlhf_test_standin_" + name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
