"""`specserve bench spectra`: the ablation takes exactly one component away from the drafter, and labels say which."""
import pytest

from bench.spectra import ABLATED, ABLATION, AGENTIC, PLANNER_OFF, TRAFFIC, ablate, depth_table, summary_entry
from drafters.model_ngrams import ModelNgrams
from drafters.retrieval import SuffixIndex
from drafters.spectra import DICTIONARIES, SpectraDrafter


def drafter_with_both_indexes() -> SpectraDrafter:
    """Both indexes and the model n-grams."""
    return SpectraDrafter(pool_size=0, traffic=SuffixIndex(2**20), corpus=SuffixIndex(2**20),
                          model_ngrams=ModelNgrams({(5,): (6, 0.9)}))


@pytest.mark.parametrize("part", ["forward", "backward"])
def test_a_dictionary_taken_away_leaves_the_other_and_both_indexes(part):
    drafter = drafter_with_both_indexes()
    ablate(drafter, part, None)
    assert drafter.dictionaries == set(DICTIONARIES) - {part}
    assert drafter.traffic is not None and drafter.corpus is not None


def test_without_retrieval_both_indexes_and_the_model_ngrams_go_and_the_dictionaries_stay():
    drafter = drafter_with_both_indexes()
    ablate(drafter, "retrieval", None)
    assert drafter.traffic is None and drafter.corpus is None and drafter.model_ngrams is None
    assert drafter.dictionaries == set(DICTIONARIES)


def test_without_model_ngrams_only_the_table_goes():
    drafter = drafter_with_both_indexes()
    ablate(drafter, "model-ngrams", None)
    assert drafter.model_ngrams is None and drafter.traffic is not None and drafter.corpus is not None


def test_without_traffic_only_the_traffic_index_goes():
    drafter = drafter_with_both_indexes()
    corpus = drafter.corpus
    ablate(drafter, TRAFFIC, None)
    assert drafter.traffic is None and drafter.corpus is corpus and drafter.dictionaries == set(DICTIONARIES)


def test_the_agentic_phase_sets_spectra_beside_itself_without_its_traffic_index():
    assert [variant.label for variant in AGENTIC] == ["none", "copyspec", "spectra-core",
                                                      "spectra without traffic planner on", "spectra planner on"]


def test_the_unfiltered_corpus_replaces_the_filtered_one_and_needs_it():
    drafter, unfiltered = drafter_with_both_indexes(), SuffixIndex(2**20)
    traffic = drafter.traffic
    ablate(drafter, "filter", unfiltered)
    assert drafter.corpus is unfiltered and drafter.traffic is traffic
    with pytest.raises(RuntimeError, match="calibrate corpus"):
        ablate(SpectraDrafter(pool_size=0), "filter", unfiltered)


def test_the_ablation_rows_take_each_component_away_once_planner_on():
    labels = [variant.label for variant in ABLATION]
    assert labels == ["none", "spectra planner on", "spectra without forward planner on",
                      "spectra without backward planner on", "spectra without retrieval planner on",
                      "spectra without model-ngrams planner on", "spectra unfiltered corpus planner on"]
    assert {variant.without for variant in ABLATION[2:]} == set(ABLATED)
    assert [variant.label for variant in PLANNER_OFF] == ["none", "ngram planner off", "spectra planner off"]


def test_the_planner_off_rows_report_acceptance_by_depth_summed_over_questions():
    def question(accepted_per_position, num_drafts):
        return {"new_tokens": 10, "seconds": 1.0, "num_drafts": num_drafts, "num_forwards": 5,
                "accepted_tokens": sum(accepted_per_position), "lookahead_rows": 0, "drafted_tokens": 9,
                "accepted_per_position": accepted_per_position, "exactness": "identical"}

    entry = summary_entry(("planner-off", "mt-bench", "draft planner off"), [question([1], 2), question([3, 2], 3)])
    assert entry["acceptance_by_depth"] == [0.8, 0.4]  # 4 of 5 drafts accepted one token or more, 2 two
    assert entry["mean_acceptance_length"] == 2.2
    table = depth_table([entry, dict(entry, variant="none", acceptance_by_depth=[])])
    assert table[-2] == "| mt-bench | draft planner off | 0.800 | 0.400 |" and len(table) == 6
