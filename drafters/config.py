"""Speculation configuration: which drafter, and its parameters (each one also a command-line flag)."""
from __future__ import annotations

from dataclasses import dataclass, field

PLD_PLUS_RANKINGS = ("auto", "hidden", "attention")


@dataclass(frozen=True)
class SpecConfig:
    drafter: str = field(default="copyspec", metadata={  # its choices are drafters.registry's names
        "help": "how tokens are drafted (docs/drafters.md); none: plain decoding"})
    copy_gamma: int = field(default=3, metadata={"help": "CopySpec match length γ (the paper's)"})
    copy_max_tokens: int = field(default=10, metadata={"help": "CopySpec tokens copied per match |S| (the paper's)"})
    ngram_k: int = field(default=10, metadata={  # the paper's reference setting (k, w) = (10, 10)
        "help": "n-grams: candidate rows per draft, merged into one tree"})
    ngram_w: int = field(default=10, metadata={"help": "n-grams: tokens per candidate row"})
    pld_num_tokens: int = field(default=10, metadata={  # Spec-Bench's default
        "help": "prompt lookup: tokens copied after a match (K)"})
    pld_plus_ranking: str = field(default="auto", metadata={"choices": PLD_PLUS_RANKINGS, "help": (
        "PLD+: rank copy sources by hidden states or induction-head attention (auto: the calibration's choice, "
        "else hidden)")})
    pld_plus_max_tokens: int = field(default=70, metadata={"help": "PLD+: tokens copied (K, the paper's)"})
    pld_plus_layer: int | None = field(default=None, metadata={
        "help": "PLD+(h): hidden-state layer (default: calibrated, else 9/32 of the depth)"})
    pld_plus_num_heads: int | None = field(default=None, metadata={
        "help": "PLD+(a): how many calibrated heads (default: as many as the calibration chose)"})
    spectra_n: int = field(default=5, metadata={  # Appendix B: 5-grams
        "help": "SPECTRA: the longest n-gram its dictionaries hold (N)"})
    spectra_guesses: int = field(default=15, metadata={"help": "SPECTRA: guesses per draft, merged into one tree (G)"})
    spectra_pool: int = field(default=15, metadata={"help": (
        "SPECTRA: chains in its candidate pool (W), advanced through look-ahead rows as the planner allows; 0: none")})
    spectra_tau: float = field(default=0.9, metadata={"help": (  # drafters/spectra.py's TAU says why not 0.1
        "SPECTRA: a pool chain takes the most probable token its forward dictionary lacks when r > tau, r ~ U(0, 1)")})
    spectra_bigram_rows: int = field(default=0, metadata={"help": (  # bench/README.md: the host time outweighs them
        "SPECTRA: rows of N - 1 tokens from the model bigram after the other guesses (raise tokens per call where "
        "every guess is verified; with the planner on, on a CPU, their host time costs more than they add); 0: none")})
    spectra_index_mib: int = field(default=64, metadata={"help": (
        "SPECTRA: host memory (MiB) of the index of finished responses every request drafts from, oldest out; "
        "0: none (spectra-core never has one)")})
    num_draft_tokens: int = field(default=5, metadata={  # k, SV's setting
        "help": "draft model: tokens drafted per step at most (the goodput planner may draft fewer)"})

    def __post_init__(self) -> None:
        for name in ("copy_gamma", "copy_max_tokens", "ngram_k", "ngram_w", "pld_num_tokens", "pld_plus_max_tokens",
                     "spectra_guesses", "num_draft_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.spectra_n < 2:
            raise ValueError("spectra_n must be at least 2")
        if min(self.spectra_pool, self.spectra_index_mib, self.spectra_bigram_rows) < 0:
            raise ValueError("spectra_pool, spectra_index_mib and spectra_bigram_rows must be at least 0")
        if not 0.0 <= self.spectra_tau <= 1.0:
            raise ValueError("spectra_tau must be within [0, 1]")
        if self.pld_plus_layer is not None and self.pld_plus_layer < 1:
            raise ValueError("pld_plus_layer must be at least 1")
        if self.pld_plus_num_heads is not None and self.pld_plus_num_heads < 1:
            raise ValueError("pld_plus_num_heads must be at least 1")
        if self.pld_plus_ranking not in PLD_PLUS_RANKINGS:
            raise ValueError(f"pld_plus_ranking must be one of {PLD_PLUS_RANKINGS}, got {self.pld_plus_ranking!r}")
