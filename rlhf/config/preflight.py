"""Checks of a run's surroundings that fail at start-up (``--cfg``, ``rlhf launch``, ``rlhf.Trainer(...)``),
before any engine or model is built, instead of minutes later on the trainer's ranks:

* a hub dataset that can be read neither from the local HF cache nor from the hub (offline: ``HF_HUB_OFFLINE``
  / ``HF_DATASETS_OFFLINE``, or the hub endpoint unreachable), instead of ``datasets``' retries;
* ``trainer.logger`` with ``wandb`` but no W&B credentials (``WANDB_API_KEY``, a ``~/.netrc`` entry for the
  W&B host) and not offline (``WANDB_MODE=offline``);
* ``data.max_prompt_length`` against the prompts of the data, and ``data.max_response_length`` against its
  reference solutions (a warning), and a split with no rows or a row without a usable prompt
  (:mod:`rlhf.data.length_check`).

:func:`preflight_problems` returns one line per problem (key, value, why, the fix) and logs the warnings (rank
0, once per process); ``rlhf.config.validate`` adds the problems to its report with ``check_files=True``.
"""
from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path
from typing import Any, Callable, Optional

from rlhf.config.refs import parse_data_ref

__all__ = ["preflight_problems", "hub_data_problems", "wandb_problems", "wandb_credentials", "hub_cached_dataset",
           "hub_unreachable"]

_TRUE = ("1", "true", "yes", "on")


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def wandb_credentials() -> bool:
    """True when W&B can log: ``WANDB_API_KEY`` set, ``WANDB_MODE`` offline/disabled/dryrun, or a netrc entry
    (``$NETRC``, default ``~/.netrc``: what ``wandb login`` writes) for the host of ``WANDB_BASE_URL``
    (default api.wandb.ai)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled",
                                                                                        "dryrun"):
        return True
    import netrc

    host = re.sub(r"^https?://", "", os.environ.get("WANDB_BASE_URL", "api.wandb.ai")).split("/")[0]
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_problems(cfg: Any) -> list[str]:
    """``trainer.logger`` includes wandb without credentials and not offline (:func:`wandb_credentials`)."""
    if "wandb" not in [str(b) for b in cfg.trainer.logger] or wandb_credentials():
        return []
    return ["trainer.logger includes wandb but no W&B credentials were found (no WANDB_API_KEY, no ~/.netrc entry "
            "for api.wandb.ai, WANDB_MODE is not offline): set WANDB_MODE=offline (upload later with `wandb sync`), "
            "or log in (`wandb login`, or WANDB_API_KEY=...), or drop wandb from trainer.logger."]


def hub_cached_dataset(name: str) -> Optional[Path]:
    """The local cache directory of hub dataset `name` (``datasets``' own cache or the hub's download cache),
    or None when neither has it.  Reads the filesystem only."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    owner, _, repo = name.partition("/")
    candidates = [Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser() / f"{owner}___{repo}",
                  Path(os.environ.get("HF_HUB_CACHE", os.environ.get("HUGGINGFACE_HUB_CACHE", home / "hub")))
                  .expanduser() / f"datasets--{owner}--{repo}"]
    return next((c for c in candidates if c.is_dir() and any(c.iterdir())), None)


def hub_unreachable(timeout_s: float = 3.0) -> Optional[str]:
    """Why the hub cannot be reached (``"HF_HUB_OFFLINE=1"``, ``"huggingface.co:443: <error>"``), or None
    when a TCP connection to ``HF_ENDPOINT`` (default https://huggingface.co) opens within `timeout_s`."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if _env_on(var):
            return f"{var}={os.environ[var]}"
    url = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host_port = re.sub(r"^https?://", "", url).split("/")[0]
    host, _, port = host_port.partition(":")
    port = int(port) if port.isdigit() else (80 if url.startswith("http://") else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        return f"{host}:{port} is unreachable ({e.strerror or e})"
    return None


def hub_data_problems(cfg: Any, unreachable: Optional[Callable[[], Optional[str]]] = None) -> list[str]:
    """Hub datasets of ``data.train_files`` / ``data.val_files`` that are not in the local cache while the hub
    cannot be reached (`unreachable`, default :func:`hub_unreachable`, asked once and only for such a
    dataset)."""
    unreachable = unreachable or hub_unreachable
    out, why = [], "unasked"
    for key in ("train_files", "val_files"):
        value = cfg.data[key]
        items = [value] if isinstance(value, str) else list(value or [])
        for i, item in enumerate(items):
            ref = parse_data_ref(item)
            if ref.kind != "hub" or hub_cached_dataset(ref.path) is not None:
                continue
            why = unreachable() if why == "unasked" else why
            if why is None:
                return out
            at = f"data.{key}" if isinstance(value, str) else f"data.{key}[{i}]"
            out.append(f"{at}={item!r} is a hub dataset that is not in the local HF cache, and the hub cannot be "
                       f"reached ({why}): download it where there is a network (datasets.load_dataset"
                       f"({ref.path!r}), then copy ~/.cache/huggingface), or give a local .jsonl/.parquet file.")
    return out


_WARNED: set = set()  # warnings already logged by this process (the checks run again for each entry point)


def preflight_problems(cfg: Any) -> list[str]:
    """Every problem of this module (module docstring), one line each; the data-length check runs only when
    the data can be read.  Its warnings are logged (logger ``rlhf.config``, rank 0, each once)."""
    from rlhf.data.length_check import length_report
    from rlhf.launch_env import launch_env

    hub = hub_data_problems(cfg)
    lengths, warnings = ([], []) if hub else length_report(cfg, hub_cached_dataset)
    for line in warnings:
        if line not in _WARNED and launch_env().rank == 0:
            _WARNED.add(line)
            logging.getLogger("rlhf.config").warning("rlhf.config: %s", line)
    return hub + wandb_problems(cfg) + lengths
