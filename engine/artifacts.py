"""The artifacts that offline calibration writes (engine/calibration/) and the engine loads at start-up.

Each artifact is a small JSON file in the model cache folder, named by a fingerprint of the
served weights (not of a path): the same weights find their artifacts wherever they were
loaded from, and weights served at another precision get artifacts of their own.
- PLD+'s calibration: which hidden layer and attention heads rank copy sources.
- SV's acceptance tables: a companion model's estimate of each drafted token's acceptance,
  over equal-frequency bins of the draft-companion overlap S and the companion's
  acceptance A (SV §4), shrunk toward the table mean where a cell holds few tokens.
- SPECTRA-retrieval's corpus: token documents the served model finds likeliest, and its table of the model's own
  confident next tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

CALIBRATION_FORMAT = 1
FINGERPRINT_STRIDE = 97  # every 97th row of the token embedding enters the fingerprint
S_BINS, A_BINS = 20, 10
SHRINK_WEIGHT = 10.0  # a cell's estimate counts the table mean as this many observations
# what `specserve calibrate corpus` makes, numbered: raised whenever its defaults change what a corpus holds, so that a
# corpus made before is named at start-up (1: the model n-grams from 1000 training prompts answered at T = 1)
CORPUS_RECIPE = 1


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specserve"


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module, weights: str) -> str:
    """16 hex digits naming the served weights: the config, how the Linear layers keep them (engine/model/weights.py),
    the dtype and a sample of the token embedding (of an EAGLE-3 head, which embeds with the target's: its own final
    norm and draft vocabulary)."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    weight = (torch.cat([model.model.norm.weight.float(), model.d2t.float()]) if hasattr(model, "d2t")
              else model.get_input_embeddings().weight)
    digest.update(f"{weights} {weight.dtype}".encode())
    digest.update(weight[::FINGERPRINT_STRIDE].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass
class PldPlusCalibration:
    ranking: str  # "hidden" or "attention": the better variant on the calibration prompts
    layer: int  # hidden-state index (1 = after the first decoder layer)
    heads: list[list[int]]  # [[layer, head], ...] best first, as many as scored best
    scores: dict[str, float]  # mean accepted-token proxy per variant, and the first-match baseline
    ranked_heads: list[list[int]]  # every head, best hit rate first (the ablation over head counts takes a prefix)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": CALIBRATION_FORMAT, **asdict(self)}, indent=1))

    @classmethod
    def load(cls, path: Path) -> PldPlusCalibration | None:
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        if data.pop("format", None) != CALIBRATION_FORMAT:
            return None
        return cls(**data)


def calibration_path(cache_dir: Path, model_fingerprint: str) -> Path:
    return cache_dir / "calibration" / f"pld-plus-{model_fingerprint}.json"


def equal_frequency_edges(values: torch.Tensor, num_bins: int) -> list[float]:
    """The inner edges of NUM_BINS bins holding as many values each (fewer bins when values repeat)."""
    quantiles = torch.quantile(values.double(), torch.linspace(0, 1, num_bins + 1, dtype=torch.float64)[1:-1])
    return sorted(set(quantiles.tolist()))


def bin_of(value: float, edges: list[float]) -> int:
    return sum(value > edge for edge in edges)


@dataclass
class SvTable:
    s_edges: list[float]
    a_edges: list[float]
    sums: list[list[float]]  # [S bins][A bins] summed acceptance
    counts: list[list[float]]
    mean: float  # the profiling run's mean acceptance
    meta: dict = field(default_factory=dict)

    @classmethod
    def fit(cls, s: torch.Tensor, a: torch.Tensor, accepted: torch.Tensor, meta: dict | None = None) -> SvTable:
        table = cls(
            equal_frequency_edges(s, S_BINS), equal_frequency_edges(a, A_BINS), [], [], float(accepted.mean()),
            meta or {},
        )
        table.sums = [[0.0] * (len(table.a_edges) + 1) for _ in range(len(table.s_edges) + 1)]
        table.counts = [[0.0] * (len(table.a_edges) + 1) for _ in range(len(table.s_edges) + 1)]
        for s_value, a_value, outcome in zip(s.tolist(), a.tolist(), accepted.tolist()):
            table.observe(s_value, a_value, outcome)
        return table

    def cell(self, s: float, a: float) -> tuple[int, int]:
        return bin_of(s, self.s_edges), bin_of(a, self.a_edges)

    def estimate(self, s: float, a: float) -> float:
        i, j = self.cell(s, a)
        return (self.sums[i][j] + SHRINK_WEIGHT * self.mean) / (self.counts[i][j] + SHRINK_WEIGHT)

    def observe(self, s: float, a: float, accepted: float) -> None:
        i, j = self.cell(s, a)
        self.sums[i][j] += accepted
        self.counts[i][j] += 1

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.__dict__))

    @classmethod
    def load(cls, path: Path) -> SvTable | None:
        return cls(**json.loads(path.read_text())) if path.is_file() else None


def sv_table_path(cache_dir: Path, fingerprints: tuple[str, ...], greedy: bool) -> Path:
    return cache_dir / "sv" / ("-".join(fingerprints) + ("-greedy" if greedy else "-sampled") + ".json")


def sv_fingerprints(target_fingerprint: str, draft, companion) -> tuple[str, ...]:
    """Names the model triple: the target's weights, and each early exit's layer count or separate model's weights.
    DRAFT and COMPANION: the engine's DraftForwards (a name, `shares_target_kv` and the module)."""
    def name(model) -> str:
        return model.name.replace(":", "") if model.shares_target_kv else weights_fingerprint(model.model, "own")

    return target_fingerprint, name(draft), name(companion)


def load_sv_tables(cache_dir: Path, fingerprints: tuple[str, ...]) -> dict[bool, SvTable]:
    """greedy? -> the calibrated table, for the modes `specserve calibrate sv` has run."""
    tables = {greedy: SvTable.load(sv_table_path(cache_dir, fingerprints, greedy)) for greedy in (True, False)}
    return {greedy: table for greedy, table in tables.items() if table is not None}


@dataclass
class SpectraCorpus:
    """SPECTRA-retrieval's corpus (`specserve calibrate corpus`): documents of token ids, lowest perplexity first, and
    the table of the model's own confident next tokens (drafters/model_ngrams.py's rows; none in a corpus made before
    it was)."""

    documents: list[list[int]]
    perplexity_cutoff: float  # the highest perplexity kept
    sources: dict[str, int]  # source -> documents kept from it
    command: str = ""
    model_ngrams: list[list[float]] = field(default_factory=list)
    recipe: int = 0  # the CORPUS_RECIPE that made it (0: one made before recipes were numbered)

    @property
    def is_outdated(self) -> bool:
        """Whether an earlier recipe made it: `specserve calibrate corpus` again makes today's."""
        return self.recipe < CORPUS_RECIPE

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": CALIBRATION_FORMAT, **asdict(self)}))

    @classmethod
    def load(cls, path: Path) -> SpectraCorpus | None:
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(**data) if data.pop("format", None) == CALIBRATION_FORMAT else None


def corpus_path(cache_dir: Path, model_fingerprint: str) -> Path:
    return cache_dir / "corpus" / f"spectra-{model_fingerprint}.json"
