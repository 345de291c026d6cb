"""Installable packages: `parallel` (the megatron-core layer: process groups, models from HF configs, forward,
optimizer, checkpoints, conversion; knows nothing of RL) and `rlhf` (the RL dataflow on top: trainer, workers,
algorithms, rewards, data, rollout, weight bridge, memory planner, config)."""
from setuptools import find_namespace_packages, setup

# One environment holds all of these (pip check clean; see README "Environment").
# sglang 0.5.23 pins torch==2.14.1 and transformers==5.19.0; megatron-core 0.16.1 is the newest
# release reachable from our CI machines.
INSTALL_REQUIRES = [
    "torch==2.14.1",
    "megatron-core==0.16.1",
    "sglang==0.5.23",
    "transformers==5.19.0",
    # [default]: the dashboard's job server (`ray job submit`, README "Running on a cluster")
    "ray[default]==2.60.0",
    "hydra-core==1.3.8",
    "omegaconf==2.3.1",
    "datasets==5.2.0",
    "pyarrow==26.0.1",
    "tensorboard==2.21.0",
    "safetensors>=0.6,<1",
    "tokenizers>=0.22",
    "numpy>=1.26,<2.4",
    "tqdm>=4.66",
    # rule rewards of the MATH / NuminaMath / Geometry3K data sources (rlhf/rewards/math_check.py): Hugging Face's
    # answer-equivalence checker; it pulls latex2sympy2_extended==1.11.0, which runs on omegaconf's antlr 4.9
    "math-verify==0.9.0",
    # the local code sandbox's HTTP server (rlhf/sandbox/server.py); sglang depends on it too
    "aiohttp>=3.9",
]

setup(
    name="rlhf-megatron-sglang",
    version="0.1.0",
    description="RLHF post-training for LLMs: PPO-family algorithms on megatron-core 3D parallelism "
                "with SGLang rollouts",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["rlhf", "rlhf.*", "parallel", "parallel.*", "recipes", "recipes.*"]),
    package_data={"rlhf": ["config/**/*.yaml", "rollout/sglang_cpu/standin/**/*.py"], "": ["*.yaml"],
                  # each recipe's config and launch scripts (recipe=NAME finds them in an installed package too)
                  "recipes": ["*/*.yaml", "*/tool_config/*.yaml", "*/*.sh", "*/*.sbatch", "*/*.py", "*/*.md", "*.md"]},
    include_package_data=True,
    install_requires=INSTALL_REQUIRES,
    extras_require={
        # Transformer Engine for CUDA 13 (torch 2.14.1 is cu130; the plain [pytorch] extra pulls the CUDA 12
        # core), inside megatron-core 0.16.1's tested range (>=2.9,<2.12).  Its PyTorch extension is an sdist
        # built against the installed torch: install with  pip install --no-build-isolation -e '.[gpu]'
        "gpu": ["transformer-engine[pytorch,core-cu13]==2.11.0"],
        # optional metrics backends (trainer.logger=[...,wandb] / mlflow); mlflow-skinny is the tracking client
        # without the server, enough for a local file store or a remote tracking server
        "wandb": ["wandb>=0.19"],
        "mlflow": ["mlflow-skinny>=2.16"],
        # the tests read wandb (offline) and mlflow (local file store) runs back: ~25 MB of wheels, <1 min
        # benchmarks/vs_trl.py: the same GRPO run through Hugging Face TRL's GRPOTrainer
        "bench": ["trl==1.16.0"],
        # the search tool's local BM25 retrieval (rlhf/agent/search.py: retrieval_service_url: local, rlhf
        # retrieval serve; numpy + scipy only) and verl's MCP tools over local stdio servers (rlhf/agent/mcp_tool.py;
        # the MCP Python SDK, 4 small wheels beside what sglang brings)
        "agent": ["bm25s==0.3.16", "mcp==2.3.0"],
        "test": ["pytest>=8", "pytest-timeout>=2.3", "wandb>=0.19", "mlflow-skinny>=2.16", "bm25s==0.3.16",
                 "mcp==2.3.0"],
    },
    entry_points={"console_scripts": ["rlhf=rlhf.cli:main"]},
)
