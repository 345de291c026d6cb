"""The chat template's incremental rendering: the token ids a new tool / user message adds to a conversation whose
earlier tokens are fixed (the model's own tokens are never decoded and re-encoded into the trained sequence).

The new ids are the suffix of the conversation rendered with the new messages (and the generation prompt) after the
conversation rendered without them: ``render(history + new, gen=True)[len(render(history)):]``, checked to be a
prefix extension.  Where a template renders the history differently once a message follows (a few reasoning
templates drop earlier thinking), the new messages are rendered alone and the template's leading system block is
removed (verl's way, tool_agent_loop.py); each such fallback is counted (``multi_turn/render_fallbacks``) and logged
once."""
from __future__ import annotations

import logging
from typing import Any, Optional

__all__ = ["ChatRenderer"]
log = logging.getLogger(__name__)


class ChatRenderer:
    """``tokenizer``'s chat template with ``tools`` (OpenAI schemas, None: none) and ``template_kwargs``."""

    def __init__(self, tokenizer: Any, tools: Optional[list] = None, template_kwargs: Optional[dict] = None):
        self.tokenizer, self.tools, self.kwargs = tokenizer, tools or None, dict(template_kwargs or {})
        self.fallbacks, self._warned = 0, False

    def _ids(self, messages: list, generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=generation_prompt,
                                                  tokenize=False, **self.kwargs)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: list) -> list[int]:
        """The first prompt: ``messages`` with the tools and the generation prompt."""
        return self._ids(messages, True)

    def delta(self, history: list, new: list) -> list[int]:
        """Ids that ``new`` messages (tool / user) add after ``history`` (which ends with an assistant message),
        ending with the generation prompt."""
        before = self._ids(history, False)
        after = self._ids(history + new, True)
        if after[:len(before)] == before:
            return after[len(before):]
        self.fallbacks += 1
        if not self._warned:
            self._warned = True
            log.warning("the chat template renders the conversation differently once a message follows: the new "
                        "messages are rendered alone (counted in multi_turn/render_fallbacks)")
        alone = self._ids(new, True)
        try:
            system = self._ids([{"role": "system", "content": ""}], False)
        except Exception:  # noqa: BLE001 - a template without a system role
            return alone
        k = 0
        while k < min(len(system), len(alone)) and system[k] == alone[k]:
            k += 1
        return alone[k:] if k == len(system) else alone
