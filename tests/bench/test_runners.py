"""bench/runners.py: engines answering one prompt together, a step at a time, give what each gives alone."""
from bench.runners import EngineRunner, Generation, acceptance_by_depth, generate_together, summed
from engine.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from engine.engine import Engine
from scheduler.config import SchedulerConfig

PROMPT = [5, 9, 13, 5, 9, 13, 5, 9, 13, 5, 9]


def runner(model_dir: str, drafter: str) -> EngineRunner:
    return EngineRunner(Engine(EngineConfig(
        model=ModelConfig(model=model_dir, device="cpu"), cache=CacheConfig(0.05),
        scheduler=SchedulerConfig(max_num_seqs=2, use_goodput_planner=False), spec=SpecConfig(drafter=drafter),
    )))


class WholeAnswer:
    """A runner that is no engine (a peer): it answers whole."""

    def __init__(self) -> None:
        self.prompts = []

    def generate(self, prompt_ids, max_new_tokens):
        self.prompts.append((list(prompt_ids), max_new_tokens))
        return Generation([1] * max_new_tokens, 0.5)


def test_engines_taking_turns_answer_as_each_does_alone(tiny_model_dir):
    runners = {"none": runner(tiny_model_dir, "none"), "copyspec": runner(tiny_model_dir, "copyspec")}
    alone = {name: r.generate(PROMPT, 24) for name, r in runners.items()}
    peer = WholeAnswer()
    together = generate_together({**runners, "peer": peer}, PROMPT, 24)
    for name in runners:
        assert together[name].token_ids == alone[name].token_ids and len(together[name].token_ids) == 24
        assert together[name].num_forwards == alone[name].num_forwards
        assert together[name].accepted_tokens == alone[name].accepted_tokens
        assert 0 < together[name].seconds
    assert together["copyspec"].num_forwards < together["none"].num_forwards  # the prompt repeats: copies pay
    assert peer.prompts == [(PROMPT, 24)] and together["peer"].seconds == 0.5


def test_each_verified_draft_counts_the_tokens_it_accepted(tiny_model_dir):
    gen = runner(tiny_model_dir, "copyspec").generate(PROMPT, 24)
    assert gen.num_drafts > 0
    assert sum(gen.accepted_per_position) == gen.accepted_tokens and gen.accepted_per_position[0] > 0
    depths = acceptance_by_depth(gen.accepted_per_position, gen.num_drafts)
    assert depths == sorted(depths, reverse=True)
    assert abs(1 + sum(depths) - (1 + gen.accepted_tokens / gen.num_drafts)) < 0.01  # the mean acceptance length


def test_acceptance_by_depth_is_the_share_of_drafts_accepted_at_least_that_deep():
    assert summed([[1, 1], [2, 1, 1]]) == [3, 2, 1]
    assert acceptance_by_depth([3, 2], 4) == [0.75, 0.5]
    assert acceptance_by_depth([], 0) == []
