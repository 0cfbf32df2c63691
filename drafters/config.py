"""Speculation configuration: which drafter, and its parameters."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecConfig:
    drafter: str = "copyspec"  # a name in drafters.registry, or "none"
    copy_gamma: int = 3  # CopySpec: length of the matched suffix (paper default 3)
    copy_max_tokens: int = 10  # CopySpec: |S|, tokens copied after a match (paper default 10)

    def __post_init__(self) -> None:
        if self.copy_gamma < 1:
            raise ValueError("copy_gamma must be at least 1")
        if self.copy_max_tokens < 1:
            raise ValueError("copy_max_tokens must be at least 1")
