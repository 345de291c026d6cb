"""The GPU image's Python environment, checked without Docker: the Dockerfile takes every pin from setup.py,
Transformer Engine is built for the image's CUDA major (without build isolation), the build fails on a
conflict, and pip resolves exactly that requirement set (slow test, needs the package index)."""
from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from tests.support.paths import REPO
DOCKERFILE = (REPO / "Dockerfile").read_text()


def setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """INSTALL_REQUIRES and extras_require of setup.py, read with ast (setup() is not run)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    install, extras = None, None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "INSTALL_REQUIRES" for t in node.targets):
            install = ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            extras = ast.literal_eval(node.value)
    assert install is not None and extras is not None, "setup.py: INSTALL_REQUIRES / extras_require not found"
    return install, extras


def image_requirements() -> list[str]:
    """What the Dockerfile installs: setup.py's requirements plus its [gpu] and [agent] extras (the agent loop's
    search and MCP tools run in the image too)."""
    install, extras = setup_requirements()
    return [*install, *extras["gpu"], *extras["agent"]]


def _cuda_major_of_base_image() -> str:
    m = re.search(r"^ARG BASE_IMAGE=nvidia/cuda:(\d+)\.[\d.]+-\S*devel", DOCKERFILE, re.M)
    assert m, "BASE_IMAGE should default to an nvidia/cuda:<X.Y.Z>-...devel image (nvcc for Transformer Engine)"
    return m.group(1)


def test_dockerfile_installs_setup_pins_strictly():
    text = DOCKERFILE
    assert text.count("\nFROM ") + text.startswith("FROM ") >= 1 and "ENTRYPOINT" not in text
    assert "python3.11" in text and "WORKDIR" in text
    assert "pip install ." in text and "pip install --no-build-isolation '.[gpu,agent]'" in text
    assert "--no-build-isolation --no-deps -e '.[gpu,agent]'" in text
    # no version pins of its own (they would drift from setup.py) and no way for a conflict to pass
    assert not re.search(r"pip install[^\n]*(==|>=)", text), "pin versions in setup.py, not in the Dockerfile"
    assert "pip check" in text and not re.search(r"pip check[^\n]*\|\|", text)
    assert "|| echo" not in text and "|| true" not in text
    ignore = (REPO / ".dockerignore").read_text().split()
    for entry in (".git", "outputs", "**/__pycache__"):
        assert entry in ignore


def test_transformer_engine_matches_the_image_cuda_and_megatron():
    install, extras = setup_requirements()
    (te,) = [Requirement(r) for r in extras["gpu"] if Requirement(r).name == "transformer-engine"]
    cuda = _cuda_major_of_base_image()
    assert "pytorch" in te.extras and f"core-cu{cuda}" in te.extras, \
        f"transformer-engine needs the core-cu{cuda} extra for the CUDA {cuda} base image (default core is CUDA 12)"
    (pin,) = [s.version for s in te.specifier if s.operator == "=="]
    # torch pinned in setup.py is a CUDA <cuda> build (the default PyPI wheel of 2.14.1 is cu130)
    torch_pin = next(Requirement(r) for r in install if Requirement(r).name == "torch")
    if md.version("torch").split("+")[0] in torch_pin.specifier:
        import torch

        assert torch.version.cuda and torch.version.cuda.split(".")[0] == cuda, (torch.version.cuda, cuda)
    # inside the range megatron-core itself declares for Transformer Engine
    mc_pin = next(Requirement(r) for r in install if Requirement(r).name == "megatron-core")
    if md.version("megatron-core") in mc_pin.specifier:
        ranges = [Requirement(r) for r in md.requires("megatron-core") or []
                  if Requirement(r).name == "transformer-engine"]
        assert ranges, "installed megatron-core declares no transformer-engine range any more"
        assert all(pin in r.specifier for r in ranges), (pin, [str(r.specifier) for r in ranges])


@pytest.mark.slow
def test_image_requirements_resolve(tmp_path):
    """pip resolves the image's requirement set (Python 3.11, setup.py pins + the [gpu] and [agent] extras) against the
    package index.  Everything but Transformer Engine is already installed here at the pinned versions
    (checked first), so pip resolves Transformer Engine and its dependencies with the rest fixed; set
    RLHF_RESOLVE_FROM_SCRATCH=1 to resolve all ~230 packages from the index (~5 min)."""
    import os

    reqs = image_requirements()
    for r in map(Requirement, reqs):
        if r.name != "transformer-engine":
            try:
                assert md.version(r.name) in r.specifier, f"installed {r.name} {md.version(r.name)} is not {r}"
            except md.PackageNotFoundError:
                pytest.fail(f"{r.name} from setup.py is not installed: pip install -e '.[test]' first")
    (tmp_path / "requirements.txt").write_text("\n".join(reqs) + "\n")
    scratch = os.environ.get("RLHF_RESOLVE_FROM_SCRATCH") == "1"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-build-isolation",
           "--report", str(tmp_path / "report.json"), "-r", str(tmp_path / "requirements.txt")]
    if scratch:
        cmd.insert(4, "--ignore-installed")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800 if scratch else 900,
                       env={**os.environ, "NVTE_FRAMEWORK": "pytorch"})
    errors = "\n".join(ln for ln in (r.stderr + r.stdout).splitlines() if not ln.startswith("WARNING: Location"))
    if r.returncode != 0 and re.search(r"(NewConnectionError|Temporary failure in name resolution|"
                                       r"Network is unreachable|Max retries exceeded)", errors):
        pytest.skip(f"the package index is unreachable from here: {errors[-300:]}")
    assert r.returncode == 0, f"the image's requirements do not resolve:\n{errors[-4000:]}"
    assert "does not provide the extra" not in errors, errors
    chosen = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
              for i in json.loads((tmp_path / "report.json").read_text())["install"]}
    te = Requirement(next(x for x in reqs if x.startswith("transformer-engine")))
    (pin,) = [s.version for s in te.specifier]
    cuda = _cuda_major_of_base_image()
    for part in ("transformer-engine", f"transformer-engine-cu{cuda}", "transformer-engine-torch"):
        assert chosen.get(part) == pin, (part, chosen.get(part))
    assert not any(re.fullmatch(r"transformer-engine-cu(?!%s)\d+" % cuda, n) for n in chosen), chosen
    if scratch:
        for x in map(Requirement, reqs):
            assert chosen[x.name.lower()] in x.specifier, (x, chosen[x.name.lower()])
