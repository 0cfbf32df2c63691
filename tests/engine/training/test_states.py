"""The target's states recorded as the engine answers (engine/training/states.py): what a head trains on must be what
a forward over the prompt and answer computes, the teacher included, however the engine batched and chunked it."""
import torch

from drafters.base import Computed
from engine.calibration.answers import answers, plain_attention
from engine.training.data import Answer, training_sample
from engine.training.states import StateRecorder, recording, teacher
from engine.wire import SamplingParams
from tests.conftest import TINY_VOCAB
from tests.engine.test_engine import make_engine

LAYERS = (1, 2)  # the tiny model has two layers; the recorder adds the last one for the teacher
DRAFT_IDS = torch.tensor([40, 3, 17, 5, 22, 9, 11, 30])  # not ascending, as a public head's d2t may have it


class Req:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def test_states_recorded_while_answering_are_a_forward_over_prompt_and_answer(tiny_model_dir):
    engine = make_engine(tiny_model_dir, "none")
    own_drafter = engine.speculation.drafter
    prompts = [[1, 5, 9, 13, 7], [1, 30, 31], [1] + list(range(3, 40))]
    params = [SamplingParams(temperature=0.0, max_tokens=9), SamplingParams(temperature=0.8, max_tokens=12, seed=3),
              SamplingParams(temperature=0.0, max_tokens=6)]
    with recording(engine, LAYERS + (2,)) as recorder:
        replies = answers(engine, prompts, params)
        recorded = [recorder.take(f"calibrate-{i}") for i in range(len(prompts))]
    assert engine.speculation.drafter is own_drafter
    model = engine.runner.model
    for prompt, answer, states in zip(prompts, replies, recorded):
        assert len(states) == len(prompt) + len(answer) - 1  # the last token is sampled, never computed
        with plain_attention((model,)), torch.no_grad():
            out = model(input_ids=torch.tensor([prompt + answer[:-1]]), output_hidden_states=True)
        assert torch.allclose(states[:, :32].float(), out.hidden_states[1][0], atol=2e-2)
        assert torch.allclose(states[:, 32:64].float(), states[:, 64:].float())  # layer 2 asked twice
        ids, probs = teacher(model, states[:, 64:], DRAFT_IDS)
        expected = torch.softmax(out.logits[0][:, DRAFT_IDS], dim=-1)
        assert ids[:, 0].tolist() == expected.argmax(-1).tolist()
        assert ids.shape == (len(states), len(DRAFT_IDS)) and torch.allclose(
            probs.float().sum(-1), torch.ones(len(states)), atol=1e-2)


def test_a_training_sample_reads_the_heads_layers_and_learns_from_the_last():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    prompt, answer = [1, 12, 30], [7, 41, 2]
    states = torch.randn(5, 4 * 32).to(torch.bfloat16)
    sample = training_sample(model, Answer(prompt, answer, False, states), DRAFT_IDS)
    assert sample.token_ids.tolist() == prompt + answer and sample.num_prompt == 3 and not sample.greedy
    assert torch.equal(sample.states[:5], states[:, :96]) and not sample.states[5].any()
    ids, probs = teacher(model, states[:, 96:], DRAFT_IDS)  # row p: the distribution of the token at p + 1
    assert torch.equal(sample.teacher_ids[2:5], ids[2:]) and torch.equal(sample.teacher_probs[2:5], probs[2:])
    assert not sample.teacher_probs[:2].any() and not sample.teacher_probs[5].any()  # rows no answer token is learnt at
    assert sample.teacher_ids.shape == sample.teacher_probs.shape == (6, len(DRAFT_IDS))


def test_a_preempted_request_is_recorded_again_from_where_it_is_computed_again():
    recorder = StateRecorder((1,))
    req = Req("r")
    recorder.begin(req)
    rows = torch.arange(12.0).view(6, 2)
    recorder.observe(req, Computed(0, [1, 2, 3, 4], hidden_states=rows[:4]))
    recorder.observe(req, Computed(4, [5], hidden_states=rows[4:5]))
    recorder.observe(req, Computed(0, [1, 2, 3], hidden_states=rows[:3] + 100))  # preempted, computed again
    recorder.observe(req, Computed(3, [4, 5, 6], hidden_states=rows[3:6] + 100))
    recorder.finish(req)
    assert torch.equal(recorder.take("r"), (rows + 100).to(torch.bfloat16))
    assert recorder.take("r") is None


def test_positions_computed_unseen_are_refused():
    recorder = StateRecorder((1,))
    req = Req("r")
    recorder.begin(req)
    recorder.observe(req, Computed(0, [1, 2], hidden_states=torch.zeros(2, 4)))
    try:
        recorder.observe(req, Computed(5, [9], hidden_states=torch.zeros(1, 4)))
    except RuntimeError as error:
        assert "2..4" in str(error)
    else:
        raise AssertionError("a gap in the recorded positions went unnoticed")
