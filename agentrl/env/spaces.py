"""Gymnasium spaces for chat environments: an observation is a list of messages, an action is text.

`gymnasium.spaces.Text` restricts characters to a charset, which a model's output never
respects; these spaces accept any Unicode and check structure instead.
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np

from agentrl.core.types import ROLES


class UnicodeText(gymnasium.Space[str]):
    """Any string of at most `max_length` characters."""

    def __init__(self, max_length: int, seed: int | np.random.Generator | None = None):
        self.max_length = max_length
        super().__init__(shape=None, dtype=None, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        n = int(self.np_random.integers(0, min(self.max_length, 64) + 1))
        return "".join(chr(int(c)) for c in self.np_random.integers(32, 0x2FF, size=n))

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"UnicodeText(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnicodeText) and other.max_length == self.max_length


class Messages(gymnasium.Space[list]):
    """A list of chat messages: dicts with a `role` in ROLES and a string `content` (plus optional str fields)."""

    def __init__(self, max_messages: int = 1024, seed: int | np.random.Generator | None = None):
        self.max_messages = max_messages
        super().__init__(shape=None, dtype=None, seed=seed)

    def contains(self, x: Any) -> bool:
        if not isinstance(x, list) or len(x) > self.max_messages:
            return False
        for m in x:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                return False
            if any(not isinstance(k, str) for k in m):
                return False
        return True

    def sample(self, mask: Any = None, probability: Any = None) -> list:
        text = UnicodeText(64, seed=int(self.np_random.integers(2**31)))
        n = int(self.np_random.integers(1, 4))
        return [
            {"role": ROLES[int(self.np_random.integers(len(ROLES)))], "content": text.sample()}
            for _ in range(n)
        ]

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Messages(max_messages={self.max_messages})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Messages) and other.max_messages == self.max_messages
