"""Training a head as EAGLE-3 does: training-time test (TTT). The head is run TTT_STEPS times over each sequence, as
it runs when drafting: step 0 reads the target's fused states (entry p: the token at p and the state at p - 1), and
step j reads, at each row, the head's own output of step j - 1 at that row with the token j positions on, at position
p + j. A row's query at step j attends to the step-0 keys of rows up to its own (the real tokens the head read with
the target's states) and to its own row's keys of steps 1..j (the tokens it drafted before), the mask SpecForge
trains with. Step j's output at row p is trained towards the target's distribution over the draft vocabulary at
position p + j (the next token after the one it read), on answer tokens whose target argmax is in the draft
vocabulary, weighted STEP_DECAY ** j. Defaults are SpecForge's (AdamW, lr 1e-4, cosine with warm-up, clipped
gradients, one sequence a step, bfloat16 mixed precision) except TTT_STEPS: 4 here, not 7, since the embedded model
drafts at most 5 tokens and each step costs a forward and backward of the head on this CPU. The mixed precision is
autocast over float32 weights where the CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX: a step takes about half
as long as in float32), float32 elsewhere (an AVX2 CPU would emulate it, slower than float32).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.decoder import rotate
from engine.model.eagle3 import Eagle3Head
from engine.training.data import Sample

TTT_STEPS = 4
STEP_DECAY = 0.8
LEARNING_RATE = 1e-4
WARMUP_SHARE = 0.015
MAX_GRAD_NORM = 0.5


def mixed_precision():
    """The context a training step and a validation run in: bfloat16 autocast where the CPU has native bfloat16."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if native_bfloat16() else nullcontext()


def native_bfloat16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@dataclass
class StepStats:
    loss: float
    correct: list[float]  # per TTT step: scored rows whose argmax is the target's most likely token
    counted: list[float]  # per TTT step: rows scored
    accepted: float = 0.0  # over rows every step scores: the steps right before the first wrong one, summed
    chains: float = 0.0  # those rows


def head_steps(head: Eagle3Head, sample: Sample, steps: int) -> list[torch.Tensor]:
    """The head's logits over the draft vocabulary at each TTT step: [steps] of [T, draft vocab] (step j's row p
    predicts the token at p + j + 1)."""
    layer, body = head.model.layers[0], head.model
    attention = layer.self_attn
    tokens = sample.token_ids
    total = len(tokens)
    fused = body.fc(sample.states.float())  # [T, hidden]: the state each entry of the next position reads
    hidden = torch.cat([torch.zeros_like(fused[:1]), fused[:-1]])
    keys, values, outputs = [], [], []
    for step in range(steps):
        read = torch.cat([tokens[step:], tokens.new_zeros(step)])  # the token j positions on (padding past the end)
        with torch.no_grad():  # the target's embedding, frozen
            embeds = head.embed(read).float()
        positions = torch.arange(step, step + total)
        cos, sin = (t[0, :, None, :] for t in body.rotary_emb(embeds, positions[None]))
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        q = rotate(attention.q_proj(x).view(total, attention.num_heads, -1), cos, sin)
        k = rotate(attention.k_proj(x).view(total, attention.num_kv_heads, -1), cos, sin)
        v = attention.v_proj(x).view(total, attention.num_kv_heads, -1)
        keys.append(k)
        values.append(v)
        out = hidden + attention.o_proj(_ttt_attention(q, keys, values, attention.scaling).reshape(total, -1))
        out = out + layer.mlp(layer.post_attention_layernorm(out))
        outputs.append(head.lm_head(body.norm(out)))
        hidden = out
    return outputs


def _ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scaling: float):
    """q [T, heads, d]; keys, values per step so far [T, kv_heads, d] -> [T, heads, d]: causal over step 0's rows,
    then each later step's key at the query's own row."""
    total, heads, _ = q.shape
    group = heads // keys[0].shape[1]
    k0, v0 = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (keys[0], values[0]))  # [heads, T, d]
    qh = q.transpose(0, 1)  # [heads, T, d]
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    scores = (qh @ k0.transpose(1, 2) * scaling).masked_fill(~causal, float("-inf"))  # [heads, T, T]
    diagonal = [(q * k.repeat_interleave(group, dim=1)).sum(-1).T[..., None] * scaling for k in keys[1:]]
    weights = torch.softmax(torch.cat([scores, *diagonal], dim=-1), dim=-1)  # [heads, T, T + steps - 1]
    out = weights[..., :total] @ v0
    for i, v in enumerate(values[1:]):
        out = out + weights[..., total + i:total + i + 1] * v.repeat_interleave(group, dim=1).transpose(0, 1)
    return out.transpose(0, 1)


def sample_loss(head: Eagle3Head, sample: Sample, steps: int) -> tuple[torch.Tensor, StepStats]:
    """The TTT loss of one sequence, and how often each step's argmax is the target's most likely token."""
    outputs = head_steps(head, sample, steps)
    total = sample.num_tokens
    loss = torch.zeros(())
    stats = StepStats(0.0, [], [])
    common = total - steps  # rows every step predicts a position of
    runs = torch.ones(max(common, 0))
    for step, logits in enumerate(outputs):
        rows = total - step - 1  # row p predicts position p + step + 1's token from the target's row p + step
        teacher_ids = sample.teacher_ids[step:step + rows].long()
        teacher_probs = sample.teacher_probs[step:step + rows].float()
        scored = _scored_rows(sample, step, rows)
        log_q = F.log_softmax(logits[:rows].float(), dim=-1)
        per_row = -(teacher_probs * log_q.gather(1, teacher_ids)).sum(-1)
        loss = loss + STEP_DECAY ** step * (per_row * scored).sum() / scored.sum().clamp(min=1)
        hits = (logits[:rows].argmax(-1) == teacher_ids[:, 0]).float()
        stats.correct.append(float((hits * scored).sum()))
        stats.counted.append(float(scored.sum()))
        runs = runs * hits[:max(common, 0)]
        stats.accepted += float((runs * _scored_rows(sample, 0, max(common, 0))).sum())
    stats.chains = float(_scored_rows(sample, 0, max(common, 0)).sum())
    stats.loss = float(loss.detach())
    return loss, stats


def _scored_rows(sample: Sample, step: int, rows: int) -> torch.Tensor:
    """[rows] 1 where the predicted position is an answer token (the prompt's last row predicts the first)."""
    predicted = torch.arange(rows) + step + 1
    return (predicted >= sample.num_prompt).float()


def learning_rate(step: int, total_steps: int, peak: float = LEARNING_RATE) -> float:
    """Linear warm-up over WARMUP_SHARE of the steps, then cosine decay to zero."""
    warmup = max(1, round(WARMUP_SHARE * total_steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def acceptance_length(stats: list[StepStats]) -> float:
    """Tokens a verification yields on average when the head drafts a chain of as many tokens as it was trained
    steps, greedily, measured as it runs: 1 + the leading steps right (a step's token is the target's most likely)."""
    return 1.0 + sum(s.accepted for s in stats) / max(1.0, sum(s.chains for s in stats))


def step_accuracies(stats: list[StepStats]) -> list[float]:
    steps = len(stats[0].correct)
    return [sum(s.correct[j] for s in stats) / max(1.0, sum(s.counted[j] for s in stats)) for j in range(steps)]
