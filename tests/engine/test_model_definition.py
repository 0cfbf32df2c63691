"""Exactness against the model's own definition: greedy continuations served by the engine with --weights float32,
by plain decoding and with speculation, equal transformers' eager float32 forward token for token (a divergence
only at a near-tie of the reference's logits, bench/exactness.py), at contexts of 300, 700, 1,500 and (for the
windowed model) 3,000 tokens.

Two models: the embedded SmolLM2, and a random model of Gemma 3's shape (tests/conftest.py `tiny_gemma_dir`: its
512-token window, at small widths so the test stays fast; the real Gemma 3 270M file is checked by
`specserve bench long-context --model gemma-3-270m`, bench/README.md)."""
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.exactness import divergence_verdict
from drafters.config import SpecConfig
from drafters.registry import build_drafter
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model.gguf_cache import loadable_source
from engine.model.model_source import resolve_model_source
from engine.model.tokenizer import load_tokenizer
from engine.wire import SamplingParams
from tests.engine.helpers import run_to_completion

CONTEXTS = (300, 700, 1500, 3000)
NEW_TOKENS = 16
POOL_GIB = 0.5  # SmolLM2's float32 KV for 3,016 positions is 139 MiB


def smollm2_prompts() -> tuple[str, list[list[int]]]:
    """The embedded model's checkpoint and prompts cut from this repository's own Python source: the contexts but
    the longest, as SmolLM2 has no window to outgrow (its eager reference forward at 3,000 tokens takes a minute)."""
    text = "\n".join(p.read_text() for p in sorted(Path("engine").rglob("*.py")))
    ids = load_tokenizer(ModelConfig()).encode(text)
    assert len(ids) > max(CONTEXTS)
    return loadable_source(resolve_model_source(None)).path, [ids[:n] for n in CONTEXTS[:-1]]


def random_prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in CONTEXTS]


def eager_continuations(path: str, prompts: list[list[int]]) -> tuple[torch.nn.Module, list[list[int]]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            generated = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                       do_sample=False, pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return model, outputs


def served(engine: Engine, prompts: list[list[int]], drafter: str) -> list[list[int]]:
    """The continuations ENGINE serves drafting with DRAFTER. One engine serves both drafters (none and copyspec
    need no drafter context): the second run finds each prompt in its session cache and decodes on the first's KV."""
    engine.speculation.drafter = build_drafter(SpecConfig(drafter=drafter), None)
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)]
    return [run_to_completion(engine, [prompt], params)["req-0"].new_token_ids for prompt in prompts]


def float32_engine(model: str | None) -> Engine:
    """A pool for the longest context and little more: the pool is zeroed at start-up, and the module keeps the
    engine (an engine lives until the garbage collector finds it)."""
    return Engine(EngineConfig(model=ModelConfig(model=model, weights="float32"), cache=CacheConfig(POOL_GIB)))


def assert_definition_kept(reference_model, prompts, expected, got) -> None:
    for prompt, want, have in zip(prompts, expected, got):
        verdict = divergence_verdict(reference_model, prompt, want, have)
        assert verdict != "mismatch", f"context {len(prompt)}: {want} != {have}"


@pytest.fixture(scope="module")
def smollm2_reference():
    path, prompts = smollm2_prompts()
    return (float32_engine(None), prompts, *eager_continuations(path, prompts))


@pytest.fixture(scope="module")
def gemma_reference(tiny_gemma_dir):
    prompts = random_prompts(512)
    return (float32_engine(tiny_gemma_dir), prompts, *eager_continuations(tiny_gemma_dir, prompts))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma"])
@pytest.mark.parametrize("drafter", ["none", "copyspec"])
def test_greedy_continuations_follow_the_models_definition_past_its_window(request, model, drafter):
    """SmolLM2 has no window; the Gemma-shaped model's 512-token window is outgrown by every context but the first."""
    engine, prompts, reference_model, expected = request.getfixturevalue(f"{model}_reference")
    assert_definition_kept(reference_model, prompts, expected, served(engine, prompts, drafter))
