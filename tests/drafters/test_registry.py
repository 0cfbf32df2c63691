"""The registry builds each drafter from its sub-config and a context, by name."""
from pathlib import Path

import pytest
import torch

from drafters.base import DrafterContext
from drafters.config import SpecConfig
from drafters.none import NoDrafter
from drafters.registry import DRAFTER_NAMES, build_drafter


def context(tmp_path: Path, vocab=16) -> DrafterContext:
    weights = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
    return DrafterContext("fingerprint", vocab, 2, tmp_path, lambda tokens: weights[tokens])


def test_registry_builds_by_name(tmp_path):
    assert DRAFTER_NAMES == ("none", "copyspec", "copyspec+draft", "draft", "ngram", "pld", "pld-plus", "spectra",
                             "spectra-core")
    assert isinstance(build_drafter(SpecConfig(drafter="none"), context(tmp_path)), NoDrafter)
    copy = build_drafter(SpecConfig(drafter="copyspec", copy_gamma=5, copy_max_tokens=7), context(tmp_path))
    assert (copy.gamma, copy.max_tokens) == (5, 7)
    ngram = build_drafter(SpecConfig(drafter="ngram", ngram_k=4, ngram_w=6), context(tmp_path))
    assert (ngram.k, ngram.w) == (4, 6) and ngram.bigram.wait(30) is not None
    spectra = build_drafter(SpecConfig(drafter="spectra", spectra_n=4, spectra_guesses=9), context(tmp_path))
    assert (spectra.n, spectra.max_guesses) == (4, 9) and spectra.traffic.max_bytes == 64 * 2**20
    assert spectra.bigram is None and spectra.bigram_guesses == 0  # no bigram rows unless asked
    with_bigram = build_drafter(SpecConfig(drafter="spectra-core", spectra_bigram_rows=3), context(tmp_path))
    assert with_bigram.bigram_guesses == 3 and with_bigram.bigram.wait(30) is not None
    core = build_drafter(SpecConfig(drafter="spectra-core"), context(tmp_path))
    assert core.traffic is None and core.name == "spectra-core"
    assert build_drafter(SpecConfig(drafter="spectra", spectra_index_mib=0), context(tmp_path)).traffic is None
    assert (tmp_path / "tables").is_dir()
    plus = build_drafter(SpecConfig(drafter="pld-plus"), context(tmp_path))  # no calibration yet: hidden states
    assert plus.ranking == "hidden" and plus.captures.hidden_layers == (1,) and plus.max_tokens == 70
    with pytest.raises(ValueError, match="calibrate"):
        build_drafter(SpecConfig(drafter="pld-plus", pld_plus_ranking="attention"), context(tmp_path))
    # the engine lends a draft model's forward only when it has one
    with pytest.raises(ValueError, match="--draft-model"):
        build_drafter(SpecConfig(drafter="copyspec+draft"), context(tmp_path))
    with pytest.raises(ValueError, match="unknown drafter"):
        build_drafter(SpecConfig(drafter="nope"), context(tmp_path))


def test_sub_configs_are_validated():
    with pytest.raises(ValueError, match="ngram_k"):
        SpecConfig(ngram_k=0)
