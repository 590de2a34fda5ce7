"""Stop tokens and stop strings, applied token by token so a sequence ends where the target alone ends."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StopChecker:
    """Holds back text that could still become a stop string, and finds where to cut."""

    stop_strings: tuple[str, ...]
    stop_token_ids: frozenset[int]
    include_stop_str: bool = False  # the matched stop string ends the text instead of being cut
    matched: str | None = field(default=None, init=False)  # the stop string that ended the sequence
    _pending: str = field(default="", init=False)

    @property
    def _hold_back(self) -> int:
        return max((len(s) for s in self.stop_strings), default=1) - 1

    def is_stop_token(self, token: int) -> bool:
        return token in self.stop_token_ids

    def add_text(self, delta: str, may_stop: bool) -> tuple[str, bool]:
        """Returns the text safe to send now, and whether a stop string ended the sequence.

        A stop string counts only if it ends in `delta`, and only when may_stop (min_tokens is reached)."""
        checked = len(self._pending)  # every stop string ending before here was looked for already
        self._pending += delta
        if not self.stop_strings:
            text, self._pending = self._pending, ""
            return text, False
        found = [(i, s) for s in self.stop_strings
                 if may_stop and (i := self._pending.find(s, max(0, checked - len(s) + 1))) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda hit: hit[0])
            end = cut + len(self.matched) if self.include_stop_str else cut
            text, self._pending = self._pending[:end], ""
            return text, True
        safe = max(0, len(self._pending) - self._hold_back)
        text, self._pending = self._pending[:safe], self._pending[safe:]
        return text, False

    def flush(self) -> str:
        """The held-back text, once the sequence ends for another reason."""
        text, self._pending = self._pending, ""
        return text
