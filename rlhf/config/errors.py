"""The config errors: what `rlhf.main` prints (exit code 2), `rlhf launch` prints and `Trainer(...)` raises."""
from __future__ import annotations

from typing import Sequence

__all__ = ["ConfigError", "ConfigKeyError", "ConfigValidationError"]


class ConfigError(ValueError):
    """Any problem with the training config found at start-up (`rlhf.main` prints it and exits 2)."""


class ConfigKeyError(ConfigError):
    """A config key (or recipe / algorithm preset name) that does not exist.

    Attributes:
        key: the full dotted key as given (``"trainer.totl_training_steps"``), or the recipe name.
        suggestions: nearest valid full keys (or recipe names), best first; may be empty.
        source: where the key came from (``"command-line override 'a.b=1'"``, ``"recipe/foo.yaml"``).
    """

    def __init__(self, message: str, key: str = "", suggestions: Sequence[str] = (), source: str = ""):
        super().__init__(message)
        self.key = key
        self.suggestions = list(suggestions)
        self.source = source


class ConfigValidationError(ConfigError):
    """One or more invalid values; ``problems`` lists each (key, value, why, fix) as one line."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"Invalid config ({len(self.problems)} problem{'s' * (len(self.problems) != 1)}):\n{lines}")
