"""SPECTRA's retrieval corpus: perplexity under the served model, the lowest kept per source within the byte bound,
the model's predictions for its table of next tokens, and the artifact the drafter loads."""
import json
import logging
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from drafters.retrieval import BYTES_PER_TOKEN
from engine.artifacts import CORPUS_RECIPE, SpectraCorpus, corpus_path
from engine.calibration.corpus import Sample, score, select
from engine.drafter_context import load_corpus


def perplexity(model, context: list[int], token_ids: list[int]) -> float:
    sample = Sample("answers", context, token_ids)
    score(model, sample)
    return sample.perplexity


def test_perplexity_is_of_the_sample_given_its_context(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    context, tokens = [1, 5, 6], [7, 8, 9, 10]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([context + tokens])).logits[0].double().log_softmax(-1)
    nll = [-logits[len(context) - 1 + i, token] for i, token in enumerate(tokens)]
    assert math.isclose(perplexity(model, context, tokens), math.exp(sum(nll) / len(nll)), rel_tol=1e-4)
    alone = [-logits[i, token] for i, token in enumerate((context + tokens)[1:])]  # no context: from the 2nd token
    assert math.isclose(perplexity(model, [], context + tokens), math.exp(sum(alone) / len(alone)), rel_tol=1e-4)


def test_the_lowest_fraction_of_each_source_is_kept_within_the_bound():
    samples = [Sample("code", [], [i] * 10, perplexity=p) for i, p in enumerate((5.0, 1.0, 3.0, 9.0))]
    samples += [Sample("answers", [], [i] * 10, perplexity=p) for i, p in enumerate((2.0, 8.0), start=10)]
    chosen, cutoff = select(samples, keep=0.5, max_bytes=10**9)
    assert [s.perplexity for s in chosen] == [1.0, 2.0, 3.0] and cutoff == 3.0  # 2 of 4 code, 1 of 2 answers
    chosen, cutoff = select(samples, keep=0.5, max_bytes=BYTES_PER_TOKEN * 25)  # room for two samples
    assert [s.perplexity for s in chosen] == [1.0, 2.0] and cutoff == 2.0


def test_the_corpus_artifact_round_trips_and_feeds_spectra(tmp_path):
    from drafters.config import SpecConfig
    from drafters.registry import build_drafter
    from tests.drafters.test_registry import context

    documents = [[7, 8, 9, 10, 11, 12], [3, 4, 5, 6]]
    SpectraCorpus(documents, 2.5, {"code": 1, "answers": 1}, "cmd").save(corpus_path(tmp_path, "fp"))
    loaded = SpectraCorpus.load(corpus_path(tmp_path, "fp"))
    assert loaded.documents == documents and loaded.perplexity_cutoff == 2.5
    ctx = context(tmp_path)
    ctx.spectra_corpus = loaded.documents
    drafter = build_drafter(SpecConfig(drafter="spectra", spectra_index_mib=0, spectra_pool=0), ctx)
    assert drafter.traffic is None and drafter.corpus.num_documents == 2 and drafter.name == "spectra"
    guesses = drafter.guesses(drafter.new_index(), [60, 61, 7, 8, 9])
    assert drafter.bigram is None and [(g.token_ids, g.kind) for g in guesses] == [([10, 11, 12], "corpus:short")]


def test_scoring_also_gives_the_models_prediction_after_each_token_of_the_sample(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    sample = Sample("answers", [1, 5, 6], [7, 8, 9])
    score(model, sample)
    with torch.no_grad():
        probs = model(input_ids=torch.tensor([[1, 5, 6, 7, 8, 9]])).logits[0, 3:].double().softmax(-1)
    assert sample.predicted == probs.argmax(-1).tolist()  # after 7, after 8, after 9
    assert sample.confidence == pytest.approx(probs.max(-1).values.tolist(), rel=1e-4)
    assert sample.perplexity == pytest.approx(perplexity(model, [1, 5, 6], [7, 8, 9]))


def test_the_model_ngrams_travel_in_the_corpus_artifact_to_spectra(tmp_path):
    from drafters.config import SpecConfig
    from drafters.model_ngrams import ModelNgrams
    from drafters.registry import build_drafter
    from tests.drafters.test_registry import context

    table = ModelNgrams({(8, 9): (10, 0.9), (3,): (4, 0.5)})
    SpectraCorpus([[3, 4, 5, 6]], 2.5, {"code": 1}, "cmd", table.to_json()).save(corpus_path(tmp_path, "fp"))
    loaded = SpectraCorpus.load(corpus_path(tmp_path, "fp"))
    ctx = context(tmp_path)
    ctx.model_ngrams = ModelNgrams.from_json(loaded.model_ngrams)
    drafter = build_drafter(SpecConfig(drafter="spectra", spectra_index_mib=0, spectra_pool=0), ctx)
    assert drafter.model_ngrams.entries == table.entries
    guesses = drafter.guesses(drafter.new_index(), [60, 61, 8, 9])
    assert [(g.token_ids, g.kind) for g in guesses] == [([10], "model:conf9")]


def test_a_corpus_made_before_the_model_ngrams_loads_without_them(tmp_path):
    path = corpus_path(tmp_path, "fp")
    SpectraCorpus([[3, 4, 5, 6]], 2.5, {"code": 1}).save(path)
    data = json.loads(path.read_text())
    del data["model_ngrams"]
    path.write_text(json.dumps(data))
    assert SpectraCorpus.load(path).model_ngrams == []


def test_a_corpus_an_earlier_recipe_made_is_served_and_named_at_start_up(tmp_path, caplog):
    path = corpus_path(tmp_path, "fp")
    SpectraCorpus([[3, 4, 5, 6]], 2.5, {"code": 1}).save(path)
    data = json.loads(path.read_text())
    del data["recipe"]  # as the calibration wrote it before recipes were numbered
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="specserve.engine"):
        corpus = load_corpus(path)
    assert corpus.documents == [[3, 4, 5, 6]] and corpus.recipe == 0 and corpus.is_outdated
    assert "earlier recipe" in caplog.text and str(path) in caplog.text
    caplog.clear()
    SpectraCorpus([[3, 4, 5, 6]], 2.5, {"code": 1}, recipe=CORPUS_RECIPE).save(path)
    with caplog.at_level(logging.WARNING, logger="specserve.engine"):
        assert not load_corpus(path).is_outdated
    assert not caplog.text
