"""The training run of `specserve train-draft`: data (cached per model and settings, so a second run with other
training settings does not answer the prompts again), a head initialised from the target (or an existing head, to
train it further on answers to other prompts: `--init`), epochs of TTT with a progress bar, a checkpoint and a
held-out validation after each, and the head with its training record at the end."""
from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from engine.artifacts import weights_fingerprint
from engine.config import EngineConfig
from engine.drafter_context import model_cache_dir
from engine.engine import Engine
from engine.model.eagle3 import Eagle3Config, Eagle3Head, aux_layers, load_eagle3_head, save_eagle3_head
from engine.model.tokenizer import load_tokenizer
from engine.training.data import SELF_WRITTEN_SHARE, TrainingData, build_training_data
from engine.training.ttt import (
    LEARNING_RATE,
    MAX_GRAD_NORM,
    TTT_STEPS,
    StepStats,
    acceptance_length,
    learning_rate,
    mixed_precision,
    native_bfloat16,
    sample_loss,
    step_accuracies,
)

logger = logging.getLogger("specserve.training")

VALIDATION_EVERY = 10  # every tenth answer is held out for validation


@dataclass(frozen=True)
class TrainOptions:
    out: Path  # the head's folder
    num_prompts: int = 1000  # training prompts answered: templates' and the model's own (training/data.py)
    max_new_tokens: int = 256  # tokens of each answer
    draft_vocab: int = 6144  # draft vocabulary: the answer tokens seen most often
    intermediate_size: int = 1024  # the head's MLP width
    epochs: int = 4
    lr: float = LEARNING_RATE
    ttt_steps: int = TTT_STEPS
    seed: int = 0
    command: str = ""
    init: Path | None = None  # a head to train further instead of a new one: its draft vocabulary, width, layers kept


# Speculative Verification's companion for a head trained with the defaults: half its MLP width, so that scoring costs
# less than drafting, trained on the answers to other prompts (the seed picks them), so that where the two heads
# disagree says something about the draft's errors (SV's companion is a model apart from the draft)
COMPANION = TrainOptions(Path("."), intermediate_size=512, seed=1)


def train_draft(config: EngineConfig, options: TrainOptions) -> None:
    torch.manual_seed(options.seed)
    engine = Engine(replace(config, spec=replace(config.spec, drafter="none")))
    target = engine.runner.model
    starting = None if options.init is None else starting_head(target, options.init)
    layers = default_layers(target.config.num_hidden_layers) if starting is None else \
        aux_layers(starting.config, target.config.num_hidden_layers)
    data = _cached_data(engine, config, options, layers, None if starting is None else starting.target_ids)
    head = starting or initial_head(target, data.draft_ids, options.intermediate_size)
    train, held_out = _split(data)
    record = {"command": options.command, "options": {k: str(v) for k, v in asdict(options).items()},
              "data": {"answers": len(data.samples), "answer_tokens": data.num_answer_tokens,
                       "train_tokens": sum(s.num_tokens for s in train), "held_out_answers": len(held_out),
                       "draft_vocab": len(data.draft_ids), "draft_vocab_coverage": round(data.coverage, 4)},
              "target_layers": list(layers), "bfloat16_autocast": native_bfloat16(), "epochs": []}
    if starting is not None:  # what the head started from scores on the same held-out answers: what training added
        record["init"] = dict(validate(head, held_out, options.ttt_steps), epoch=0, head=str(options.init))
        logger.info("train-draft: the starting head: %s", record["init"])
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=options.lr, weight_decay=0)
    total_steps, step, start = options.epochs * len(train), 0, time.monotonic()
    for epoch in range(1, options.epochs + 1):
        random.Random(options.seed + epoch).shuffle(train)
        head.train()
        losses = []
        for sample in tqdm(train, desc=f"epoch {epoch}/{options.epochs}", unit="answer"):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, total_steps, options.lr)
            with mixed_precision():
                loss, _ = sample_loss(head, sample, options.ttt_steps)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            losses.append(loss.item())
            step += 1
        validation = validate(head, held_out, options.ttt_steps)
        validation.update(epoch=epoch, train_loss=round(sum(losses) / len(losses), 4),
                          minutes=round((time.monotonic() - start) / 60, 1))
        record["epochs"].append(validation)
        logger.info("train-draft: epoch %d: %s", epoch, validation)
        save_eagle3_head(head, options.out / "checkpoints" / f"epoch-{epoch}", target.config.vocab_size)
    if not record["epochs"]:
        print(f"training data ready (no epochs asked): {record['data']}")
        return
    save_eagle3_head(head, options.out, target.config.vocab_size)
    (options.out / "training.json").write_text(json.dumps(record, indent=1))
    print(f"head saved to {options.out}: validation acceptance length {record['epochs'][-1]['acceptance_length']} "
          f"at {options.ttt_steps} drafted tokens")


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default target layers for a head (engine/model/eagle3.py's aux_layers), which a config without ids
    means: a head trained on them needs none written."""
    return 2, num_layers // 2, num_layers - 3


def initial_head(target: torch.nn.Module, draft_ids: torch.Tensor, intermediate_size: int) -> Eagle3Head:
    """A head shaped like the target's layers (its attention heads, norms and rotary base), its LM head and final norm
    started from the target's own rows and norm, the rest at random; the target's embedding, frozen, embeds."""
    c = target.config
    config = Eagle3Config(
        vocab_size=c.vocab_size, draft_vocab_size=len(draft_ids), hidden_size=c.hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings, hidden_act="silu",
        rope_parameters=getattr(c, "rope_parameters", None), tie_word_embeddings=False,
    )
    embed = target.get_input_embeddings()
    head = Eagle3Head(config, embed)
    with torch.no_grad():
        output = target.get_output_embeddings()
        rows = output.weight if isinstance(getattr(output, "weight", None), torch.Tensor) and \
            output.weight.shape == embed.weight.shape else embed.weight
        head.lm_head.weight.copy_(rows[draft_ids].float())
        head.model.norm.weight.copy_(target.model.norm.weight.float())
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    return head.float()


def starting_head(target: torch.nn.Module, path: Path) -> Eagle3Head:
    """The head in folder PATH, in float32 to train further, embedding with the target's (frozen) embedding."""
    head = load_eagle3_head(path, target.get_input_embeddings(), torch.float32, torch.device("cpu"))
    if head.config.hidden_size != target.config.hidden_size:
        raise ValueError(f"{path} is a head {head.config.hidden_size} wide; this model's states are "
                         f"{target.config.hidden_size} wide")
    return head


@torch.no_grad()
def validate(head: Eagle3Head, held_out: list, steps: int) -> dict:
    """Acceptance on the held-out greedy answers as the head drafts a chain of STEPS tokens, and each step's
    agreement with the target's most likely token on every held-out answer."""
    head.eval()
    with mixed_precision():
        stats: list[StepStats] = [sample_loss(head, sample, steps)[1] for sample in held_out]
    greedy = [s for s, sample in zip(stats, held_out) if sample.greedy]
    return {"acceptance_length": round(acceptance_length(greedy or stats), 3),
            "step_accuracy": [round(a, 3) for a in step_accuracies(stats)],
            "loss": round(sum(s.loss for s in stats) / len(stats), 4)}


def _split(data: TrainingData) -> tuple[list, list]:
    train = [s for i, s in enumerate(data.samples) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    held_out = [s for i, s in enumerate(data.samples) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    return train, held_out


def _cached_data(
    engine: Engine, config: EngineConfig, options: TrainOptions, layers: tuple, draft_ids: torch.Tensor | None,
) -> TrainingData:
    """The training data for these settings (DRAFT_IDS: a starting head's vocabulary, else the answers choose one),
    from the model cache folder if an earlier run made it."""
    target = engine.runner.model
    vocabulary = options.draft_vocab if draft_ids is None else \
        hashlib.sha256(draft_ids.numpy().tobytes()).hexdigest()[:16]
    key = json.dumps([weights_fingerprint(target, engine.weights), options.num_prompts, options.max_new_tokens,
                      vocabulary, options.seed, list(layers), SELF_WRITTEN_SHARE])
    path = model_cache_dir(config.model) / "draft-heads" / f"data-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if path.exists():
        logger.info("train-draft: training data from %s", path)
        return torch.load(path, weights_only=False)
    data = build_training_data(engine, load_tokenizer(config.model), layers, options.num_prompts,
                               options.max_new_tokens, options.draft_vocab, options.seed, draft_ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)
    return data
