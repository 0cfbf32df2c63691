"""Training a draft head (engine/training/): training-time test computes what the head computes when it drafts,
its attention mask, the loss it learns from, what a head starts from, and the data's pieces."""
import torch

from engine.model.eagle3 import load_eagle3_head
from engine.training import data
from engine.training.data import Sample, draft_vocabulary, self_written_prompts, user_turn_prefix
from engine.training.prompts import training_prompts
from engine.training.train import default_layers, initial_head, starting_head
from engine.training.ttt import (
    StepStats,
    _scored_rows,
    _ttt_attention,
    acceptance_length,
    head_steps,
    learning_rate,
    mixed_precision,
    native_bfloat16,
    sample_loss,
)
from tests.conftest import TINY_VOCAB
from tests.engine.model.test_draft_model import draft_engine


def random_sample(length: int, hidden: int, num_prompt: int = 3, seed: int = 0, draft_vocab: int = 24) -> Sample:
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.rand(length, 4, generator=generator)
    return Sample(
        token_ids=torch.randint(3, TINY_VOCAB, (length,), generator=generator), num_prompt=num_prompt,
        states=torch.randn(length, 3 * hidden, generator=generator).to(torch.bfloat16),
        teacher_ids=torch.randint(0, draft_vocab, (length, 4), generator=generator).to(torch.int32),
        teacher_probs=(teacher / teacher.sum(-1, keepdim=True)).half(),
    )


def test_training_time_test_computes_what_the_head_computes_when_drafting(tiny_model_dir, tiny_head_dir):
    """Step 0 at row p: the head having read tokens 0..p with the target's states (position p reads the state at
    p - 1). Step 1 at row p: then the drafted entry at position p + 1, reading the token there and the head's own
    output at row p. The served head (packed runner, paged KV) must give the same logits as training's."""
    engine = draft_engine(tiny_model_dir, tiny_head_dir)
    forward = engine.speculation.drafter.forward
    head = forward.model
    sample = random_sample(10, hidden=32)
    with torch.no_grad():
        trained = head_steps(head, sample, steps=2)
    fused = forward.fuse(sample.states.float())
    reads = torch.cat([torch.zeros(1, fused.shape[1]), fused[:-1]])
    tokens = sample.token_ids.tolist()
    for p in (4, 8):
        table_id = f"row-{p}"
        forward.blocks.grow(table_id, p + 2)
        logits, outputs = forward.run([(table_id, tokens[:p + 1], 0)], [reads[:p + 1]])
        assert torch.allclose(logits[0][0], trained[0][p], atol=1e-4)
        logits, _ = forward.run([(table_id, [tokens[p + 1]], p + 1)], [outputs[0]])
        assert torch.allclose(logits[0][0], trained[1][p], atol=1e-4)
        forward.blocks.free(table_id)


def test_a_later_steps_query_sees_earlier_rows_of_step_zero_and_its_own_row_of_each_later_step():
    torch.manual_seed(0)
    total, heads, kv_heads, dim = 5, 4, 2, 8
    q = torch.randn(total, heads, dim)
    keys = [torch.randn(total, kv_heads, dim) for _ in range(3)]
    values = [torch.randn(total, kv_heads, dim) for _ in range(3)]
    out = _ttt_attention(q, keys, values, scaling=0.3)
    for row in range(total):
        for h in range(heads):
            kv = h // 2
            seen_k = torch.cat([keys[0][:row + 1, kv], keys[1][row:row + 1, kv], keys[2][row:row + 1, kv]])
            seen_v = torch.cat([values[0][:row + 1, kv], values[1][row:row + 1, kv], values[2][row:row + 1, kv]])
            expected = torch.softmax(seen_k @ q[row, h] * 0.3, dim=0) @ seen_v
            assert torch.allclose(out[row, h], expected, atol=1e-5)


def test_a_few_steps_of_training_lower_the_loss_and_leave_the_targets_embedding_alone(tiny_head_dir):
    embed = torch.nn.Embedding(TINY_VOCAB, 32)
    before = embed.weight.detach().clone()
    head = load_eagle3_head(tiny_head_dir, embed, torch.float32, torch.device("cpu")).train()
    sample = random_sample(12, hidden=32)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first, _ = sample_loss(head, sample, steps=3)
    for _ in range(20):
        loss, _ = sample_loss(head, sample, steps=3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < 0.8 * float(first.detach())
    assert torch.equal(embed.weight, before) and embed.weight.grad is None


def test_mixed_precision_learns_what_float32_learns(tiny_head_dir):
    """A step under bfloat16 autocast (where the CPU has it) gives float32's loss and gradients to bfloat16's
    precision, and the weights it updates stay float32."""
    losses, grads, embed = [], [], torch.nn.Embedding(TINY_VOCAB, 32)
    for context in (torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", enabled=False)):
        head = load_eagle3_head(tiny_head_dir, embed, torch.float32, torch.device("cpu")).train()
        with context:
            loss, _ = sample_loss(head, random_sample(16, hidden=32), steps=3)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None]))
        assert all(p.dtype == torch.float32 for p in head.parameters())
    assert abs(losses[0] - losses[1]) <= 0.02 * abs(losses[1])
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.99


def test_mixed_precision_is_float32_where_the_cpu_has_no_native_bfloat16(monkeypatch):
    from engine.training import ttt
    monkeypatch.setattr(ttt, "native_bfloat16", lambda: False)
    with mixed_precision():
        assert not torch.is_autocast_enabled("cpu")
    monkeypatch.setattr(ttt, "native_bfloat16", lambda: True)
    with mixed_precision():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert isinstance(native_bfloat16(), bool)


def test_only_answer_positions_are_scored():
    sample = random_sample(8, hidden=32, num_prompt=5)
    assert _scored_rows(sample, 0, 7).tolist() == [0, 0, 0, 0, 1, 1, 1]  # row p predicts position p + 1
    assert _scored_rows(sample, 2, 5).tolist() == [0, 0, 1, 1, 1]  # step 2's row p predicts position p + 3


def test_acceptance_length_counts_the_leading_steps_right():
    stats = [StepStats(0.0, [1, 1], [2, 2], accepted=3.0, chains=2.0), StepStats(0.0, [0, 0], [1, 1], 0.0, 1.0)]
    assert acceptance_length(stats) == 2.0  # 1 + 3 steps right over 3 chains


def test_the_learning_rate_warms_up_then_decays_to_zero():
    rates = [learning_rate(step, 1000, peak=1.0) for step in range(1000)]
    assert rates[0] < rates[14] == 1.0 and rates[500] < 0.55 and rates[-1] < 1e-4


def test_a_new_head_starts_from_the_targets_rows_and_norm(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    draft_ids = torch.tensor([3, 5, 40])
    head = initial_head(target, draft_ids, intermediate_size=16)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[draft_ids])
    assert head.target_ids.tolist() == [3, 5, 40] and head.config.draft_vocab_size == 3
    assert default_layers(30) == (2, 15, 27)  # vLLM's default, which a config without ids means


def test_the_draft_vocabulary_is_the_answer_tokens_seen_most_often():
    ids, coverage, total = draft_vocabulary([[7, 7, 8, 9], [7, 8, 10, 7]], 2)
    assert ids.tolist() == [7, 8] and total == 8 and coverage == 6 / 8


def test_a_head_trained_further_keeps_its_own_draft_vocabulary_in_its_own_order():
    ids, coverage, total = draft_vocabulary([[7, 7, 8, 9], [7, 8, 10, 7]], 2, given=torch.tensor([10, 8, 3]))
    assert ids.tolist() == [10, 8, 3] and total == 8 and coverage == 3 / 8


def test_training_further_starts_from_the_heads_own_weights_in_float32(tiny_model_dir, tiny_head_dir):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    head = starting_head(target, tiny_head_dir)
    assert head.dtype == torch.float32 and head.embed is target.get_input_embeddings()
    assert head.target_ids.tolist() == list(range(0, TINY_VOCAB, 2))
    assert all(p.requires_grad for p in head.parameters())
    wider = LlamaForCausalLM(LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    try:
        starting_head(wider, tiny_head_dir)
    except ValueError as error:
        assert "32 wide" in str(error) and "64 wide" in str(error)
    else:
        raise AssertionError("a head of another width was taken")


def test_train_draft_init_names_the_head_to_train_further(monkeypatch, tmp_path):
    import specserve
    from engine import training

    seen = []
    monkeypatch.setattr(training, "train_draft", lambda config, options: seen.append(options))
    specserve.main(["train-draft", "--out", str(tmp_path / "out"), "--init", str(tmp_path / "head")])
    specserve.main(["train-draft", "--out", str(tmp_path / "out")])
    assert [o.init for o in seen] == [tmp_path / "head", None]


def test_training_prompts_are_distinct_and_seeded():
    prompts = training_prompts(600, seed=3)
    assert len(set(prompts)) == 600 and prompts == training_prompts(600, seed=3) != training_prompts(600, seed=4)


def embedded_tokenizer():
    from engine.config import ModelConfig
    from engine.model.tokenizer import load_tokenizer

    return load_tokenizer(ModelConfig(model=None))


def test_the_user_turn_prefix_ends_where_a_users_message_begins():
    from engine.calibration.prompts import chat_prompt_ids

    tokenizer = embedded_tokenizer()
    prefix = user_turn_prefix(tokenizer)
    [rendered] = chat_prompt_ids(tokenizer, ("Plan a trip to Iceland.",))
    assert rendered[:len(prefix)] == prefix
    assert tokenizer.decode(rendered[len(prefix):]).startswith("Plan a trip to Iceland.")
    assert tokenizer.decode(prefix).endswith("user\n")


def test_self_written_prompts_keep_messages_the_model_ended_with_enough_words_once(monkeypatch):
    tokenizer = embedded_tokenizer()
    eos = tokenizer.eos_token_id
    rounds = [
        ["Can you plan a trip to Iceland?", "Too short.", "Can you plan a trip to Iceland?",
         "This message never reaches its own end", "Explain how tides work, please."],
        ["What should I cook for six friends tonight?"],
    ]
    calls = []

    def scripted(engine, prompts, params):
        calls.append((prompts, params))
        texts = rounds[len(calls) - 1]
        ended = [t != "This message never reaches its own end" for t in texts]
        return [tokenizer.encode(t, add_special_tokens=False) + [eos] * e for t, e in zip(texts, ended)]

    monkeypatch.setattr(data, "answers", scripted)
    kept = self_written_prompts(object(), tokenizer, 3, seed=1)
    assert kept == ["Can you plan a trip to Iceland?", "Explain how tides work, please.",
                    "What should I cook for six friends tonight?"]
    assert all(prompt == user_turn_prefix(tokenizer) for prompts, _ in calls for prompt in prompts)
    seeds = [p.seed for _, params in calls for p in params]
    assert len(set(seeds)) == len(seeds) and all(p.temperature == 1.0 for _, params in calls for p in params)


def test_train_draft_companion_trains_a_narrower_head_on_other_prompts_unless_told_otherwise(monkeypatch, tmp_path):
    """`specserve train-draft --companion`: the companion's MLP width and seed, each still overridable by its flag."""
    import specserve
    from engine import training
    from engine.training import COMPANION, TrainOptions

    seen = []
    monkeypatch.setattr(training, "train_draft", lambda config, options: seen.append(options))
    for extra in ([], ["--companion"], ["--companion", "--seed", "7", "--intermediate-size", "96"]):
        specserve.main(["train-draft", "--out", str(tmp_path), *extra])
    default, companion, told = ((o.intermediate_size, o.seed) for o in seen)
    assert default == (TrainOptions(tmp_path).intermediate_size, TrainOptions(tmp_path).seed)
    assert companion == (COMPANION.intermediate_size, COMPANION.seed) != default
    assert told == (96, 7)
