"""Speculation configuration: which drafter, and its parameters."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecConfig:
    drafter: str = "copyspec"  # a name in drafters.registry, or "none"
    copy_gamma: int = 3  # CopySpec: length of the matched suffix (paper default 3)
    copy_max_tokens: int = 10  # CopySpec: |S|, tokens copied after a match (paper default 10)
    ngram_k: int = 10  # n-grams: candidate rows per draft (the paper's reference setting (k, w) = (10, 10))
    ngram_w: int = 10  # n-grams: tokens per row

    def __post_init__(self) -> None:
        for name in ("copy_gamma", "copy_max_tokens", "ngram_k", "ngram_w"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
