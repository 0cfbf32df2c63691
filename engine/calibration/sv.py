"""The companion estimator of Speculative Verification (SV, §4): what each model-drafted token is worth.

After drafting, a companion model c (an early exit of the target, or a small model of its vocabulary) scores the
drafted tokens. Per token x with draft distribution q:
    S = sum_v min(q(v), c(v))       the draft-companion overlap (1 - total variation),
    A = min(1, c(x) / q(x))         x's acceptance if the companion were the target.
The estimate of x's acceptance (given its parent's) is a table over equal-frequency bins of S (SV: 10-30) and of A
(SV: 10-20), each cell the mean expected acceptance min(1, p(x)/q(x)) of the profiling run's tokens in it (lower
variance than 0/1 outcomes), shrunk toward the table's mean where a cell holds few tokens (SHRINK_WEIGHT tokens), and
updated online with observed outcomes. One table per (target, draft, companion) and decoding mode, in the model cache
directory; depth is not a table dimension (SV's table has none).
Profiling (`specserve calibrate sv`) is teacher-forced on prompts of no benchmark set (engine/calibration/prompts.py):
the target answers each prompt; one forward each of target, draft and companion over prompt + answer gives every
position's distributions, and a drafted token is drawn from q (temperature 1) or is q's argmax (greedy). Given an
accepted prefix a drafted token sees exactly the target's context, so each position is one token of plain speculation.
EAGLE-3 heads (a draft head and its companion head) draft from the target's states and then from their own outputs,
so each is run as it trains (engine/training/ttt.py): at every answer position, the tokens at depths 1..k of a chain
whose earlier tokens were accepted (the target's own, teacher-forced), each head reading its own outputs from depth 2.
"""
from __future__ import annotations

import json
import math

import msgspec
import torch

from drafters.model_draft import overlap_and_acceptance
from engine.artifacts import SvTable, sv_fingerprints, sv_table_path
from engine.calibration.answers import answers, plain_attention
from engine.calibration.options import CalibrationOptions
from engine.calibration.prompts import CALIBRATION_PROMPTS, CHAT_PROMPTS, chat_prompt_ids
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.draft_model import DraftForward
from engine.model.eagle3 import load_eagle3_head
from engine.model.tokenizer import load_tokenizer
from engine.sampler import target_probs
from engine.wire import SamplingParams

ENTROPY_BINS = 10  # the acceptance probability is discretised into this many equal bins for its entropy (SV Table 2)


def entropy(labels: list[tuple]) -> float:
    """Shannon entropy (bits) of the empirical distribution of LABELS."""
    counts: dict[tuple, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    total = len(labels)
    return -sum(n / total * math.log2(n / total) for n in counts.values())


def conditional_entropy(target: list[int], given: list[tuple]) -> float:
    """H(target | given) = H(target, given) - H(given)."""
    return entropy([(t, *g) for t, g in zip(target, given)]) - entropy(given)


def information_gain_table(accepted: torch.Tensor, s: torch.Tensor, a: torch.Tensor, table: SvTable) -> dict:
    """SV Table 2 with adaptive bins: H(acceptance), H(. | S), H(. | A), H(. | S, A), and the gain of (S, A)."""
    target = [min(int(x * ENTROPY_BINS), ENTROPY_BINS - 1) for x in accepted.tolist()]
    cells = [table.cell(sv, av) for sv, av in zip(s.tolist(), a.tolist())]
    h = entropy([(t,) for t in target])
    h_s = conditional_entropy(target, [(i,) for i, _ in cells])
    h_a = conditional_entropy(target, [(j,) for _, j in cells])
    h_sa = conditional_entropy(target, cells)
    return {"entropy": h, "given_S": h_s, "given_A": h_a, "given_S_and_A": h_sa,
            "information_gain": h - h_sa, "information_gain_share": (h - h_sa) / h if h else 0.0}


def brier(estimates: torch.Tensor, outcomes: torch.Tensor) -> float:
    return float(((estimates - outcomes) ** 2).mean())


SAMPLED_TEMPERATURE = 0.7  # the sampled table's temperature: SV's evaluation setting


def teacher_forced_tokens(target, draft, companion, prompt: list[int], answer: list[int], params, generator) -> dict:
    """At each answer position, the token the draft model drafts given the target's own prefix and what SV observes
    of it: (S, A) and its acceptance min(1, p(x)/q(x)) (greedy: whether it is the target's argmax)."""
    ids = torch.tensor([prompt + answer])
    rows = slice(len(prompt) - 1, len(prompt) + len(answer) - 1)
    p, q, c = (torch.stack([DraftForward.probs(row, params) for row in _plain_logits(model, ids)[rows]])
               for model in (target, draft, companion))
    tokens = q.argmax(-1) if params.greedy else torch.multinomial(q, 1, generator=generator)[:, 0]
    s, a = overlap_and_acceptance(q, c, tokens)
    picked = torch.arange(len(tokens))
    accepted = ((p.argmax(-1) == tokens).float() if params.greedy
                else (p[picked, tokens] / q[picked, tokens]).clamp(max=1.0))
    return {"S": s, "A": a, "accepted": accepted}


def _model_observations(engine, prompts: list[list[int]], answered: list[list[int]], params, generator) -> list[dict]:
    models = (engine.runner.model, engine.draft_forward.runner.model, engine.companion_forward.runner.model)
    with plain_attention(models):
        return [teacher_forced_tokens(*models, prompt, answer, params, generator)
                for prompt, answer in zip(prompts, answered)]


def _head_observations(engine, prompts: list[list[int]], answered: list[list[int]], params, generator) -> list[dict]:
    """The heads' observations, each head loaded afresh in float32 from its folder (serving may keep its weights in
    another form)."""
    target = engine.runner.model
    heads = [load_eagle3_head(forward.name, target.get_input_embeddings(), torch.float32, torch.device("cpu"))
             for forward in (engine.draft_forward, engine.companion_forward)]
    with plain_attention((target,)):
        return [head_teacher_forced_tokens(target, *heads, engine.draft_forward.target_layers, prompt, answer,
                                           params, generator, engine.num_draft_tokens)
                for prompt, answer in zip(prompts, answered) if answer]


@torch.inference_mode()
def head_teacher_forced_tokens(
    target, draft, companion, layers: tuple[int, ...], prompt: list[int], answer: list[int], params, generator,
    depth: int,
) -> dict:
    """As `teacher_forced_tokens`, for a draft head and its companion head reading the target's states at LAYERS,
    at each depth 1..DEPTH of a chain (each depth's tokens drafted given the target's tokens before them)."""
    from engine.training.data import Sample  # engine/training/ imports this package: imported when used
    from engine.training.ttt import head_steps  # the same

    ids = torch.tensor(prompt + answer)
    out = target(input_ids=ids[None], output_hidden_states=True)
    states = torch.cat([out.hidden_states[layer][0] for layer in layers], dim=-1)
    sample = Sample(ids, len(prompt), states, torch.empty(0), torch.empty(0))
    p_logits = out.logits[0].float()
    by_head = [head_steps(head, sample, depth) for head in (draft, companion)]
    observed = {"S": [], "A": [], "accepted": [], "depth": [], "Q": []}
    for step, (q_logits, c_logits) in enumerate(zip(*by_head)):
        rows = torch.arange(len(prompt) - 1, len(ids) - step - 1)  # chains of answer tokens
        if not len(rows):
            continue
        p = _processed(p_logits[rows + step], params)
        q, c = (_processed(_widened(head, logits[rows]), params) for head, logits in ((draft, q_logits),
                                                                                     (companion, c_logits)))
        tokens = q.argmax(-1) if params.greedy else torch.multinomial(q, 1, generator=generator)[:, 0]
        s, a = overlap_and_acceptance(q, c, tokens)
        picked = torch.arange(len(tokens))
        accepted = ((p.argmax(-1) == tokens).float() if params.greedy
                    else (p[picked, tokens] / q[picked, tokens]).clamp(max=1.0))
        depth = torch.full_like(s, step + 1)
        for key, value in zip(observed, (s, a, accepted, depth, q[picked, tokens])):
            observed[key].append(value)
    return {key: torch.cat(values) for key, values in observed.items()}


def _widened(head, logits: torch.Tensor) -> torch.Tensor:
    """[n, draft vocab] -> [n, target vocab], -inf outside the head's draft vocabulary."""
    full = logits.new_full((len(logits), head.config.vocab_size), float("-inf"))
    full[:, head.target_ids] = logits
    return full


def _processed(logits: torch.Tensor, params) -> torch.Tensor:
    """[n, vocab] -> the distributions a request with PARAMS samples from (a plain softmax when greedy)."""
    return torch.softmax(logits.float(), dim=-1) if params.greedy else target_probs(logits, params)


def _plain_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[positions, vocab] logits of a plain forward (within `plain_attention`)."""
    with torch.inference_mode():
        return model(input_ids=ids).logits[0].float()


def calibrate_sv(
    engine, prompts: list[list[int]], max_tokens: int, greedy: bool, seed: int = 0
) -> tuple[SvTable, dict]:
    """Answer PROMPTS with ENGINE's target, profile SV's observations on them, and fit the table; the report holds
    each estimator's Brier score and the information-gain table on the odd prompts, with the table fitted on the
    even ones (the saved table is fitted on all)."""
    params = SamplingParams(temperature=0.0 if greedy else SAMPLED_TEMPERATURE, max_tokens=max_tokens, seed=seed)
    answered = answers(engine, prompts, [msgspec.structs.replace(params, seed=seed + i) for i in range(len(prompts))])
    generator = torch.Generator().manual_seed(seed)
    observe = _head_observations if engine.draft_forward.is_head else _model_observations
    observed = observe(engine, prompts, answered, params, generator)
    fit_half, test_half = (_joined(observed[start::2]) for start in (0, 1))
    half_table = SvTable.fit(fit_half["S"], fit_half["A"], fit_half["accepted"])
    report = evaluate(half_table, test_half, generator, fit_half)
    everything = _joined(observed)
    return SvTable.fit(
        everything["S"], everything["A"], everything["accepted"], {"greedy": greedy, "num_tokens": len(everything["S"])}
    ), report


def evaluate(table: SvTable, observed: dict, generator: torch.Generator, fitted: dict | None = None) -> dict:
    """Brier scores of the companion table and of the statistical estimate (the profiling run's mean acceptance) on
    OBSERVED tokens, against their acceptance probability and against accept/reject draws of it. Heads' observations
    also carry each token's depth and the draft head's own probability of it, so two more estimators are scored:
    the mean acceptance at each depth of the FITTED tokens (the serving statistics' form), and the head's probability
    (what a head's drafts carry without a companion; an estimate of a greedy token's acceptance only)."""
    estimates = torch.tensor([table.estimate(s, a) for s, a in zip(observed["S"].tolist(), observed["A"].tolist())])
    statistical = torch.full_like(estimates, table.mean)
    accepted = observed["accepted"]
    draws = (torch.rand(len(accepted), generator=generator) < accepted).float()
    report = {
        "num_tokens": len(accepted),
        "brier_companion": brier(estimates, accepted), "brier_statistical": brier(statistical, accepted),
        "brier_companion_vs_outcomes": brier(estimates, draws),
        "brier_statistical_vs_outcomes": brier(statistical, draws),
    }
    if "depth" in observed and fitted is not None:
        by_depth = {int(d): float(fitted["accepted"][fitted["depth"] == d].mean()) for d in fitted["depth"].unique()}
        depth_means = torch.tensor([by_depth.get(int(d), table.mean) for d in observed["depth"].tolist()])
        report["brier_statistical_by_depth"] = brier(depth_means, accepted)
        report["brier_draft_probability"] = brier(observed["Q"], accepted)
    report["information_gain"] = information_gain_table(accepted, observed["S"], observed["A"], table)
    return report


def _joined(observed: list[dict]) -> dict:
    return {key: torch.cat([o[key] for o in observed]) for key in observed[0]}


def write_sv_tables(config: EngineConfig, options: CalibrationOptions) -> None:
    """Profile the draft and companion models on the calibration prompts (engine/calibration/prompts.py: PLD+'s
    and short chat prompts, none from a benchmark set) and keep SV's acceptance table, greedy and sampled."""
    if not (config.model.draft_model and config.model.companion_model):
        raise SystemExit("specserve calibrate sv needs --draft-model and --companion-model")
    prompts = chat_prompt_ids(load_tokenizer(config.model), CALIBRATION_PROMPTS + CHAT_PROMPTS)
    engine = Engine(config)
    fingerprints = sv_fingerprints(engine.model_fingerprint, engine.draft_forward, engine.companion_forward)
    reports = {}
    for greedy in (True, False):
        table, reports["greedy" if greedy else "sampled"] = calibrate_sv(
            engine, prompts, options.max_new_tokens, greedy
        )
        path = sv_table_path(engine.cache_dir, fingerprints, greedy)
        table.save(path)
        print(f"SV table ({'greedy' if greedy else 'sampled'}, {table.meta['num_tokens']} tokens) saved to {path}")
    reports["command"] = options.command
    print(json.dumps(reports, indent=1))
    if options.out:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(json.dumps(reports, indent=1))
