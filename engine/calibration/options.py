"""What `specserve calibrate` takes besides the engine's flags."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CalibrationOptions:
    max_new_tokens: int = 192  # tokens of each calibration answer
    out: Path | None = None  # sv: also write the Brier scores and information gain here
    command: str = ""  # the command line, recorded in what `out` receives
    corpus_keep: float = 0.5  # corpus: the fraction of each source's samples kept, lowest perplexity first
    corpus_mib: int = 16  # corpus: the index the kept samples may fill (drafters/retrieval.py's bytes per token)
    corpus_sampled_prompts: int = 1000  # corpus: training prompts answered at T = 1 for the model n-grams' table
    model_ngrams_mib: int = 16  # corpus: the model n-grams' table at most (drafters/model_ngrams.py's bytes an entry)
