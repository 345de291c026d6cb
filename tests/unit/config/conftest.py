"""verl's example configs log to wandb; here W&B runs offline unless a test says otherwise (the credentials check
itself is tests/unit/config/test_preflight.py, which clears WANDB_MODE)."""
import pytest


@pytest.fixture(autouse=True)
def _wandb_offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
