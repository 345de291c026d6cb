"""The config errors: what `rlhf.main` prints (exit code 2), `rlhf launch` prints and `Trainer(...)` raises."""
from __future__ import annotations

from typing import Sequence


class ConfigError(ValueError):
    """Any problem with the training config found at start-up (`rlhf.main` prints it and exits 2)."""


class ConfigKeyError(ConfigError):
    """A key (or recipe / preset name) that does not exist: ``key`` as given, ``suggestions`` (the nearest valid
    names, best first), ``source`` (where it came from), ``problems`` (every problem found with it, one line each)."""

    def __init__(self, message: str, key: str = "", suggestions: Sequence[str] = (), source: str = "",
                 problems: Sequence[str] = ()):
        super().__init__(message)
        self.key, self.suggestions, self.source = key, list(suggestions), source
        self.problems = list(problems) or [" ".join(message.splitlines()[:2])]


class ConfigValidationError(ConfigError):
    """One or more invalid values; ``problems`` lists each (key, value, why, fix) as one line."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__(f"Invalid config ({len(problems)} problem{'s' * (len(problems) != 1)}):\n"
                         + "\n".join(f"  - {p}" for p in problems))


def raise_all(unknown: Sequence[ConfigKeyError], problems: Sequence[str]) -> None:
    """Raise every problem at once: one unknown key alone as itself; unknown keys with other problems as one
    :class:`ConfigKeyError` (``key`` / ``suggestions`` of the first unknown key); only bad values as
    :class:`ConfigValidationError`.  Returns when there is nothing to raise."""
    if len(unknown) == 1 and not problems:
        raise unknown[0]
    if unknown:
        lines, first = [" ".join(u.args[0].splitlines()[:2]) for u in unknown] + list(problems), unknown[0]
        raise ConfigKeyError(str(ConfigValidationError(lines)), first.key, first.suggestions, first.source, lines)
    if problems:
        raise ConfigValidationError(problems)
