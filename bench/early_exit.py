"""How good an early exit of the served model is as a draft model (self-speculative decoding), per exit layer N.

The early exit at layer N is the model's first N decoder layers, then its final norm and LM head. For each N = 1..L-1
it measures, on the default model (SmolLM2-135M-Instruct, loaded as the engine loads it, on the CPU, one torch thread):
* acceptance, teacher-forced: the target answers 16 prompts (the 8 PLD+ calibration prompts and 8 short chat prompts)
  greedily, up to 96 new tokens; one forward over prompt+answer gives hidden_states[N], and norm + lm_head + argmax
  before each answer token is the exit's guess for it; alpha_N is the share of answer tokens it guesses right;
* expected accepted tokens per k=5 draft: the i.i.d. estimate sum_{i=1..5} alpha^i, and the faithful one, the mean run
  of consecutive matches from each answer position (capped at 5), which under greedy decoding is what the target
  accepts (`expected_accepted_walk` averages it only over the positions a real loop verifies from);
* cost on a 200-token KV context: medians of 30 timed forwards of one token through the full model, of six (a k=5
  verification), of norm+lm_head alone and of one token through the exit, taking turns within each repeat;
  cost_ratio_linear is the equal-cost-layers estimate, as a cross-check;
* estimated speedup of greedy k=5 speculation: (1 + E_runs) / (5 * cost_N / full + verify_6 / full), ignoring the
  drafting loop's Python overhead and that the exit's KV could be shared with the target.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.calibration.prompts import CALIBRATION_PROMPTS, CHAT_PROMPTS
from engine.config import ModelConfig
from engine.model.model_loader import load_model
from engine.model.tokenizer import load_tokenizer

NEW_TOKENS = 96
DRAFT_LEN = 5
CONTEXT_LEN = 200
REPEATS = 30


def generate_answers(model, tok, prompts: list[str], eos_ids: list[int]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) per prompt; an answer ends at EOS (kept) or after NEW_TOKENS tokens."""
    pairs = []
    for text in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos_ids)
        pairs.append((list(ids), out[0, len(ids):].tolist()))
    return pairs


def exit_matches(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """[L-1, len(answer)] bools: whether the exit at layer N (row N-1) predicts each answer token greedily."""
    seq = torch.tensor([prompt + answer])
    hidden = model(input_ids=seq, output_hidden_states=True).hidden_states
    before = slice(len(prompt) - 1, len(prompt) + len(answer) - 1)  # the position that predicts each answer token
    target = torch.tensor(answer)
    rows = [model.lm_head(model.model.norm(h[0, before])).argmax(-1) == target for h in hidden[1:-1]]
    return torch.stack(rows)


def run_lengths(match: torch.Tensor) -> torch.Tensor:
    """Per position t: consecutive matches at t, t+1, ..., capped at DRAFT_LEN (and at the sequence's end)."""
    runs, current = torch.zeros(len(match)), 0
    for t in range(len(match) - 1, -1, -1):
        current = current + 1 if match[t] else 0
        runs[t] = min(current, DRAFT_LEN)
    return runs


def walk_accepted(runs: torch.Tensor) -> list[float]:
    """Accepted tokens of each verification in a speculative loop over the answer: from t, accept runs[t], move on."""
    accepted, t = [], 0
    while t < len(runs):
        accepted.append(float(runs[t]))
        t += int(runs[t]) + 1
    return accepted


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def step_fn(model, context: torch.Tensor, layers: int, new_tokens: int):
    """A forward of `new_tokens` tokens through the first `layers` layers on its own prefilled CONTEXT_LEN cache."""
    model.config.num_hidden_layers = layers  # LlamaModel runs layers[:num_hidden_layers]; its cache gets as many
    cache = model(input_ids=context[None], use_cache=True).past_key_values
    step = context[:new_tokens][None]

    def forward():
        model.config.num_hidden_layers = layers
        model(input_ids=step, past_key_values=cache, use_cache=True)
        cache.crop(-new_tokens)  # drop the step's tokens: back to CONTEXT_LEN

    return forward


def timings(model, context: torch.Tensor) -> dict:
    """Median step times; the configurations take turns in every repeat, so load from elsewhere hits them alike."""
    layers = model.config.num_hidden_layers
    row = torch.randn(1, 1, model.config.hidden_size)
    try:
        fns = {"full_step_ms": step_fn(model, context, layers, 1),
               "verify_step_ms": step_fn(model, context, layers, DRAFT_LEN + 1),
               "lm_head_ms": lambda: model.lm_head(model.model.norm(row)),
               **{n: step_fn(model, context, n, 1) for n in range(1, layers)}}
        samples = {key: [] for key in fns}
        for repeat in range(REPEATS + 1):  # the first round is a warm-up
            for key, fn in fns.items():
                ms = timed_ms(fn)
                if repeat:
                    samples[key].append(ms)
    finally:
        model.config.num_hidden_layers = layers
    med = {key: statistics.median(v) for key, v in samples.items()}
    return {"full_step_ms": med["full_step_ms"], "verify_step_ms": med["verify_step_ms"],
            "lm_head_ms": med["lm_head_ms"], "exit_step_ms": {n: med[n] for n in range(1, layers)}}


def layer_rows(matches: list[torch.Tensor], t: dict) -> list[dict]:
    rows = []
    for i in range(matches[0].shape[0]):
        per_prompt = [m[i] for m in matches]
        alpha = float(torch.cat(per_prompt).float().mean())
        runs = [run_lengths(m) for m in per_prompt]
        e_runs = float(torch.cat(runs).mean())
        walk = [a for r in runs for a in walk_accepted(r)]
        cost = t["exit_step_ms"][i + 1] / t["full_step_ms"]
        head, full, n_layers = t["lm_head_ms"], t["full_step_ms"], len(t["exit_step_ms"]) + 1
        linear = (head + (i + 1) / n_layers * (full - head)) / full  # if every layer cost the same
        rows.append({"layer": i + 1, "alpha": alpha,
                     "expected_accepted_iid": sum(alpha ** k for k in range(1, DRAFT_LEN + 1)),
                     "expected_accepted_runs": e_runs, "expected_accepted_walk": statistics.mean(walk),
                     "cost_ratio": cost, "cost_ratio_linear": linear,
                     "estimated_speedup": (1 + e_runs) / (DRAFT_LEN * cost + t["verify_step_ms"] / t["full_step_ms"])})
    return rows


def print_table(rows: list[dict], t: dict) -> None:
    print(f"full step {t['full_step_ms']:.2f} ms, 6-token verify {t['verify_step_ms']:.2f} ms, "
          f"norm+lm_head {t['lm_head_ms']:.2f} ms (median of {REPEATS}, {CONTEXT_LEN}-token context)")
    print(f"{'N':>3} {'alpha':>6} {'E_iid':>6} {'E_runs':>6} {'E_walk':>6} {'cost':>6} {'linear':>6} {'speedup':>7}")
    for r in rows:
        print(f"{r['layer']:>3} {r['alpha']:6.3f} {r['expected_accepted_iid']:6.2f} {r['expected_accepted_runs']:6.2f} "
              f"{r['expected_accepted_walk']:6.2f} {r['cost_ratio']:6.3f} {r['cost_ratio_linear']:6.3f} "
              f"{r['estimated_speedup']:7.3f}")
    best = max(rows, key=lambda r: r["estimated_speedup"])
    print(f"best: N={best['layer']} estimated speedup {best['estimated_speedup']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/models/early_exit.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(ModelConfig(num_threads=1))
    model, tok = loaded.model, load_tokenizer(ModelConfig())
    prompts = list(CALIBRATION_PROMPTS) + list(CHAT_PROMPTS)
    with torch.inference_mode():
        pairs = generate_answers(model, tok, prompts, loaded.eos_token_ids)
        matches = [exit_matches(model, p, a) for p, a in pairs]
        context = torch.tensor([i for p, a in pairs for i in p + a][:CONTEXT_LEN])
        t = timings(model, context)
    rows = layer_rows(matches, t)
    print_table(rows, t)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python -m bench.early_exit " + shlex.join(sys.argv[1:]),
        "model": loaded.source.name, "weights": loaded.weights, "num_hidden_layers": model.config.num_hidden_layers,
        "torch_threads": torch.get_num_threads(), "draft_len": DRAFT_LEN, "context_len": CONTEXT_LEN,
        "repeats": REPEATS, "answer_tokens": sum(len(a) for _, a in pairs), "timings_ms": t, "layers": rows,
        "prompts": prompts, "answer_lengths": [len(a) for _, a in pairs],
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
