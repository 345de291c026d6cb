"""``<trainer.default_local_dir>/config.yaml``: the composed config of a run, written at its start by
``python -m rlhf.main`` and ``rlhf.Trainer.run`` (global rank 0), so the run's outputs say what was trained
(``scripts/convert_checkpoint.py mcore-to-hf --ckpt`` reads the model reference from it)."""
import os

RUN_CONFIG = "config.yaml"


def write_run_config(cfg) -> str:
    """Write the composed config to ``<trainer.default_local_dir>/config.yaml`` (tmp + rename); returns the path."""
    from omegaconf import OmegaConf

    os.makedirs(cfg.trainer.default_local_dir, exist_ok=True)
    path = os.path.join(cfg.trainer.default_local_dir, RUN_CONFIG)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(OmegaConf.to_yaml(cfg, resolve=True))
    os.replace(path + ".tmp", path)
    return path
