"""The conversation harness: turn prompts from earlier answers, base models' texts to continue, the long-context
run's contexts, and peer servers compared by text."""
from bench.long_context import context_questions, long_code
from bench.mt import _peer_lines, _peer_row, completion_prompt, turn_prompts
from bench.runners import Generation
from tests.conftest import TEST_DATA_DIR


class Tokens:
    """A stand-in tokenizer: the chat template as a flat list of role tags and words; a text's tokens its words."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [word for m in messages for word in (m["role"], *m["content"].split())] + ["assistant"]

    def encode(self, text):
        return text.split()

    def decode(self, words, skip_special_tokens=False):
        return " ".join(words)


def test_a_base_models_prompt_is_its_text_with_no_chat_template():
    assert completion_prompt(Tokens(), {"turns": ["ask"], "completion": "def f(x):"}) == ["def", "f(x):"]


def test_the_long_context_run_cuts_one_long_file_at_each_context_length():
    text = long_code(TEST_DATA_DIR)
    questions = context_questions(Tokens(), text, (20, 60))
    assert [len(q["completion"].split()) for q in questions] == [20, 60]
    assert text.split()[:60] == questions[1]["completion"].split()


def test_each_turn_is_asked_after_the_baselines_answers_to_the_turns_before():
    question = {"turns": ["one", "two", "three"]}
    assert turn_prompts(Tokens(), question, None) == ["user", "one", "assistant"]
    assert turn_prompts(Tokens(), question, "A") == ["user", "one", "assistant", "A", "user", "two", "assistant"]
    assert turn_prompts(Tokens(), question, ["A", "B"])[-4:] == ["B", "user", "three", "assistant"]


def generation(text: str) -> Generation:
    return Generation([1, 2], 1.0, text=text)


def test_a_peer_is_compared_by_text_with_none_and_its_speculation_with_its_own_plain_output():
    question = {"question_id": 7, "category": "writing"}
    gens = {"llama-server": generation("same"), "llama-server-spec": generation("other")}
    plain = _peer_row(question, 2, "llama-server", gens["llama-server"], "same", gens)
    spec = _peer_row(question, 2, "llama-server-spec", gens["llama-server-spec"], "same", gens)
    assert plain["identical_to_baseline"] and plain["identical_to_peer_plain"] is None
    assert not spec["identical_to_baseline"] and spec["identical_to_peer_plain"] is False
    assert spec["exactness"] == "differs"  # never "mismatch": that word is for our own losslessness
    lines = _peer_lines([plain, spec])
    assert lines == [
        "llama-server, turn 2: 1 of 1 outputs textually identical to `none`.",
        "llama-server-spec, turn 2: 0 of 1 outputs textually identical to `none`, 0 of 1 to its own plain output.",
    ]
