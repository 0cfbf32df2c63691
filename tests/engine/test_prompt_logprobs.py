"""Prompt log-probabilities (engine/logprobs.py `PromptLogprobs`): each prompt token's log-probability under the
model, equal to a forward of the whole prompt through transformers' own model, whatever the session cache or another
request held, however the prefill was chunked, and unchanged by speculation."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from drafters.config import SpecConfig
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.wire import EngineRequest, SamplingParams
from scheduler.config import SchedulerConfig
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import run_to_completion

TOP = 3
PROMPT = [1] + [(7 * i * i + 3 * i) % (TINY_VOCAB - 3) + 3 for i in range(1, 150)]


def make_engine(model_dir: str, drafter: str = "none", step_tokens: int = 512) -> Engine:
    """The planner is off: every draft is verified."""
    return Engine(EngineConfig(
        model=ModelConfig(model=model_dir, device="cpu"), cache=CacheConfig(0.05),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=step_tokens, use_goodput_planner=False),
        spec=SpecConfig(drafter=drafter),
    ))


@pytest.fixture(scope="module")
def engines(tiny_model_dir) -> dict[str, Engine]:
    """One engine per configuration for the module: each start profiles its latency."""
    return {"none": make_engine(tiny_model_dir), "chunked": make_engine(tiny_model_dir, step_tokens=64),
            "copyspec": make_engine(tiny_model_dir, "copyspec"), "spectra": make_engine(tiny_model_dir, "spectra")}


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> torch.Tensor:
    """[len(PROMPT) - 1] the log-probability of each prompt token after the first, from transformers' forward."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    return logprobs[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])], logprobs


def scored(engine: Engine, prompt: list[int], request_id: str = "req-0", session_id: str | None = None,
           max_tokens: int = 4, temperature: float = 0.0):
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=max_tokens, ignore_eos=True,
                            prompt_logprobs=TOP)
    assert engine.add_request(EngineRequest(request_id, prompt, params, session_id=session_id)) is None
    entries = None
    while engine.has_work:
        for output in engine.step().outputs:
            if output.request_id == request_id and output.prompt_logprobs is not None:
                assert entries is None, "prompt log-probabilities are sent once"
                entries = output.prompt_logprobs
    return entries


def assert_match_reference(entries, reference) -> None:
    token_logprobs, logprobs = reference
    assert len(entries) == len(PROMPT) and entries[0] is None
    got = torch.tensor([entry.logprob for entry in entries[1:]])
    assert torch.allclose(got, token_logprobs, atol=1e-4), (got - token_logprobs).abs().max()
    for position, entry in enumerate(entries[1:]):
        assert entry.token_id == PROMPT[position + 1]
        top = torch.topk(logprobs[position], TOP)
        assert entry.top_token_ids == top.indices.tolist()
        assert entry.rank == int((logprobs[position] > logprobs[position, entry.token_id]).sum()) + 1


@pytest.mark.parametrize("name", ["none", "chunked"])
def test_prompt_logprobs_equal_the_models_forward_in_one_prefill_or_in_chunks(engines, reference, name):
    assert_match_reference(scored(engines[name], PROMPT, f"whole-{name}"), reference)


def test_prompt_logprobs_never_depend_on_what_was_cached(tiny_model_dir, engines, reference):
    """The prompt's first half is cached (an explicit session's turn) before the whole prompt is scored in that
    session: the figures equal a fresh engine's, bit for bit, though the cache would have served the half."""
    fresh = scored(make_engine(tiny_model_dir), PROMPT)
    engine = engines["none"]
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    assert engine.add_request(EngineRequest("warm", PROMPT[:75], warm, session_id="s")) is None
    while engine.has_work:
        engine.step()
    warmed = scored(engine, PROMPT, "scored", session_id="s")
    assert [(e.token_id, e.logprob, e.top_token_ids) for e in warmed[1:]] == [
        (e.token_id, e.logprob, e.top_token_ids) for e in fresh[1:]]
    assert_match_reference(warmed, reference)
    probe = run_to_completion(engine, [PROMPT], [warm])["req-0"]  # the same prompt unscored reads the cache
    assert probe.num_cached_tokens >= 75


@pytest.mark.parametrize("drafter", ["copyspec", "spectra"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_changes_no_prompt_logprob_and_no_output(engines, reference, drafter, temperature):
    params = [SamplingParams(temperature=temperature, seed=5, max_tokens=24, ignore_eos=True, prompt_logprobs=TOP)]
    want = run_to_completion(engines["none"], [PROMPT], params)["req-0"]
    got = run_to_completion(engines[drafter], [PROMPT], params)["req-0"]
    assert got.new_token_ids == want.new_token_ids
    assert got.spec.num_draft_tokens > 0 or temperature, "greedy, the output repeats: the drafter drafted"
    assert [(e.token_id, e.logprob) for e in got.prompt_logprobs[1:]] == [
        (e.token_id, e.logprob) for e in want.prompt_logprobs[1:]]
    assert_match_reference(got.prompt_logprobs, reference)


def test_a_one_token_prompt_has_one_null_entry(engines):
    assert scored(engines["none"], [1], "one-token") == [None]
