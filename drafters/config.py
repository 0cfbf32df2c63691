"""Speculation configuration: which drafter, and its parameters."""
from __future__ import annotations

from dataclasses import dataclass

PLD_PLUS_RANKINGS = ("auto", "hidden", "attention")


@dataclass(frozen=True)
class SpecConfig:
    drafter: str = "copyspec"  # a name in drafters.registry, or "none"
    copy_gamma: int = 3  # CopySpec: length of the matched suffix (paper default 3)
    copy_max_tokens: int = 10  # CopySpec: |S|, tokens copied after a match (paper default 10)
    ngram_k: int = 10  # n-grams: candidate rows per draft (the paper's reference setting (k, w) = (10, 10))
    ngram_w: int = 10  # n-grams: tokens per row
    pld_num_tokens: int = 10  # prompt lookup: K, tokens copied after a match (Spec-Bench's default)
    pld_plus_ranking: str = "auto"  # PLD+: hidden | attention | auto (the calibration's choice, else hidden)
    pld_plus_max_tokens: int = 70  # PLD+: K, tokens copied after the ranked candidate (the paper's)
    pld_plus_layer: int | None = None  # PLD+(h): hidden-state layer; None = the calibration's, else 9/32 of the depth
    pld_plus_num_heads: int | None = None  # PLD+(a): the calibration's best N heads; None = as many as it chose
    num_draft_tokens: int = 5  # draft model: tokens drafted per step at most (k; SV's setting)

    def __post_init__(self) -> None:
        for name in ("copy_gamma", "copy_max_tokens", "ngram_k", "ngram_w", "pld_num_tokens", "pld_plus_max_tokens", "num_draft_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.pld_plus_layer is not None and self.pld_plus_layer < 1:
            raise ValueError("pld_plus_layer must be at least 1")
        if self.pld_plus_num_heads is not None and self.pld_plus_num_heads < 1:
            raise ValueError("pld_plus_num_heads must be at least 1")
        if self.pld_plus_ranking not in PLD_PLUS_RANKINGS:
            raise ValueError(f"pld_plus_ranking must be one of {PLD_PLUS_RANKINGS}, got {self.pld_plus_ranking!r}")
