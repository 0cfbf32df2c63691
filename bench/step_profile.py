"""Where an engine step's time goes: one decode step and one 16-token verify step, at batch 1 and 16.

In-process engine on the served model. B requests with 512-token contexts (an MT-Redundant question, its text repeated
as a long first answer, and its second turn) are prefilled; then each measured step is timed phase by phase
(schedule, forward, verify, update, draft, the wire's encoding of the step's outputs), and the forward's operators are
timed with torch's profiler and sorted into matmuls, attention, the other tensor operators, whole decoder layers run as
one C++ call, and what is left of the forward's wall time: Python, transformers' module calls and PyTorch's dispatch.
A verify step carries 15 drafted tokens per request (the planner off, every one verified); its drafts copy the
request's own prompt. With `--draft-model`, a third kind of step: the draft model drafts MODEL_DRAFT_TOKENS levels for
every request (the planner off; a greedy head's tree holds more tokens than levels), and its drafting time per level
and per drafted token is set beside a decode step's time: the
decode steps of the same engine, timed between its drafting steps (drafting turned off for two steps: the first
verifies the last draft, the second is a plain decode), so that the ratio holds on a host whose speed drifts between
cases. Each figure is the median over the repeats.

The row ladder: at batch 1, steps verifying 0, 1, 2, ... drafted tokens (LADDER), each repeat timing every count in
turn, so that a drift of the host's speed falls on all of them alike. Its slope is what a verified row costs at batch 1
beside a decode step: a drafted token pays only where it is accepted more often than its row and its drafting cost
together take of a decode step.

With `--draft-model`, last, a single stream as served (the planner on): `none` and `draft` answer the first
SERVING_PROMPTS MT-Bench questions (turn 1, greedy, SERVING_TOKENS new tokens), the two engines in turns, the first
question a warm-up. Over their decode steps: milliseconds and tokens a step, drafted tokens verified a step (the
planner's choice) and the share of them accepted, and what a verified drafted token adds to a step beside `none`'s
(its drafting, its row and the planner's work together): the acceptance a drafted token needs to pay.
"""
from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import msgspec
import torch

from bench.data import load_questions
from bench.mt import turn_prompts
from drafters.base import Draft
from engine.engine import Engine, _wire_output
from engine.wire import EngineOutputs, EngineRequest, SamplingParams

REPEATS = 7
DRAFT_LEN = 15  # drafted tokens per request in a verify step: 16 tokens with the last real one
MODEL_DRAFT_TOKENS = 5  # tokens the draft model drafts per request in a drafting step
CONTEXT_LEN = 512  # tokens of each request's context when it is measured
LADDER = (0, 1, 2, 3, 5, 7)  # drafted tokens verified per step in the row ladder (batch 1): a few, as drafters verify
SERVING_PROMPTS = 8  # MT-Bench questions of the single-stream comparison, the first a warm-up
SERVING_TOKENS = 192  # new tokens of each answer there
PHASES = ("schedule", "forward", "verify", "update", "draft", "wire")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",
              "specserve::block_linear",
              "aten::mkldnn_linear", "aten::_mkl_linear")
WHOLE_LAYER_OP = "specserve::decoder_layer"  # a decoder layer in one call: its matmuls, attention and norms inside
ATTENTION_OPS = ("specserve::row_attention", "specserve::span_attention", "specserve::spans_attention",
                 "scaled_dot_product", "aten::index_select", "aten::index_put_", "aten::masked_fill", "aten::einsum")


def category(op_name: str) -> str:
    if op_name.startswith(WHOLE_LAYER_OP):
        return "whole layers"
    if any(op_name.startswith(m) for m in MATMUL_OPS):
        return "matmuls"
    if any(a in op_name for a in ATTENTION_OPS):
        return "attention"
    return "other operators"


class FixedDraft:
    """Drafts LENGTH tokens for every request, copied from its own prompt."""

    def __init__(self, drafter, length: int = DRAFT_LEN) -> None:
        self.inner = drafter
        self.length = length

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, reqs):
        return [Draft(list(req.prompt_token_ids[:self.length]), "fixed") for req in reqs]


def prefilled_engine(config, prompts: list[list[int]]):
    engine = Engine(config)
    for i, prompt in enumerate(prompts):
        engine.add_request(
            EngineRequest(f"p{i}", prompt, SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True))
        )
    while any(not req.is_decoding for req in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    return engine


def timed_step(engine, profile: bool) -> tuple[dict[str, float], dict[str, float] | None, int]:
    """One step phase by phase (ms), its forward's operators by category (ms) when PROFILE, and its token count."""
    times = {}
    start = time.perf_counter()
    sched_out = engine.scheduler.schedule()
    times["schedule"] = time.perf_counter()
    profiling = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else nullcontext()
    with profiling as profiler:
        batch, model_out = engine._execute(sched_out)
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize(engine.runner.device)  # the forward's kernels end here, not in the verify phase
    times["forward"] = time.perf_counter()
    results, _ = engine._verify(sched_out.scheduled, model_out)
    times["verify"] = time.perf_counter()
    update = engine.scheduler.update(sched_out, results)
    engine.runner.move_kv(update.kv_moves)
    times["update"] = time.perf_counter()
    engine._after_update(sched_out, batch, model_out, results, update)
    times["draft"] = time.perf_counter()
    msgspec.msgpack.encode(EngineOutputs([_wire_output(u, None, None) for u in update.updates], update.stats))
    times["wire"] = time.perf_counter()
    phases, previous = {}, start
    for phase in PHASES:
        phases[phase], previous = (times[phase] - previous) * 1000, times[phase]
    return phases, operator_times(profiler) if profile else None, sched_out.num_scheduled_tokens


def operator_times(profiler) -> dict[str, float]:
    by_category = {"matmuls": 0.0, "attention": 0.0, "other operators": 0.0, "whole layers": 0.0}
    for event in profiler.key_averages():
        if "::" in event.key:
            by_category[category(event.key)] += event.self_cpu_time_total / 1000
    return by_category


def profile_case(config, prompts: list[list[int]], verify: bool, model_draft: bool = False) -> dict:
    drafter = "draft" if model_draft else "copyspec" if verify else "none"
    config = replace(config, spec=replace(config.spec, drafter=drafter, num_draft_tokens=MODEL_DRAFT_TOKENS))
    engine = prefilled_engine(config, prompts)
    weights = engine.weights
    if verify:
        engine.speculation.drafter = FixedDraft(engine.speculation.drafter)
        decoding = [req for req in engine.scheduler.running if req.is_decoding]
        engine.scheduler.set_drafts(decoding, engine.speculation.propose(decoding))
    timed_step(engine, profile=False)  # one-off work stays out
    plain, decode, nodes = [], [], []
    for _ in range(REPEATS):  # with a draft model: a decode step, then a step drafting after a 1-token forward
        if model_draft:
            decode.append(sum(decode_between_drafts(engine)[0].values()))
        plain.append(timed_step(engine, profile=False))
        if model_draft:
            nodes.append(drafted_per_request(engine))
    profiled = [timed_step(engine, profile=True) for _ in range(REPEATS)]
    phases = {p: round(statistics.median(s[0][p] for s in plain), 2) for p in PHASES}
    operators = {c: round(statistics.median(s[1][c] for s in profiled), 2) for c in profiled[0][1]}
    operators["python, modules, dispatch"] = round(max(phases["forward"] - sum(operators.values()), 0.0), 2)
    step = f"draft {MODEL_DRAFT_TOKENS}" if model_draft else "verify 16" if verify else "decode"
    row = {"batch": len(prompts), "step": step, "tokens": plain[0][2], "weights": weights,
           "step_ms": round(sum(phases.values()), 2), "phases_ms": phases, "forward_ms": operators}
    if model_draft:
        row["decode_step_ms"] = round(statistics.median(decode), 2)
        row["drafted_per_request"] = round(statistics.median(nodes), 2)
    return row


def drafted_per_request(engine) -> float:
    """The tokens the step just drafted per decoding request: MODEL_DRAFT_TOKENS levels, more where a greedy
    request's draft is a tree (drafters/head_draft.py)."""
    drafts = [len(req.draft) if req.draft else 0 for req in engine.scheduler.running if req.is_decoding]
    return statistics.mean(drafts) if drafts else 0.0


def row_ladder(config, prompt: list[int]) -> dict:
    """Steps of one request verifying each count of LADDER drafted tokens (the planner off), every count timed in
    turn within a repeat: the median step milliseconds by count, and the least-squares slope over the counts from 1
    (a verified row's milliseconds); the tokens each count's step carried."""
    engine = prefilled_engine(config, [prompt])
    drafter = engine.speculation.drafter = FixedDraft(engine.speculation.drafter)
    times: dict[int, list[float]] = {count: [] for count in LADDER}
    tokens: dict[int, int] = {}
    for repeat in range(REPEATS + 1):  # the first repeat's one-off work stays out
        for count in LADDER:
            drafter.length = count
            decoding = [req for req in engine.scheduler.running if req.is_decoding]
            engine.scheduler.set_drafts(decoding, drafter.propose(decoding))
            phases, _, tokens[count] = timed_step(engine, profile=False)
            if repeat:
                times[count].append(sum(phases.values()))
    step_ms = {count: round(statistics.median(values), 2) for count, values in times.items()}
    drafted = [count for count in LADDER if count]
    slope, _ = statistics.linear_regression(drafted, [step_ms[count] for count in drafted])
    return {"batch": 1, "step_ms_by_drafted": step_ms, "tokens_by_drafted": tokens, "ms_per_row": round(slope, 4),
            "row_share_of_decode": round(slope / step_ms[0], 4)}


def decode_between_drafts(engine) -> tuple[dict[str, float], None, int]:
    """A plain decode step of ENGINE, which drafts with a model, as `timed_step` gives it: drafting off for two steps
    (the first verifies the draft before it), the second timed, then drafting back on."""
    drafter = engine.speculation.drafter
    max_tokens, drafter.max_tokens = drafter.max_tokens, 0
    try:
        timed_step(engine, profile=False)
        return timed_step(engine, profile=False)
    finally:
        drafter.max_tokens = max_tokens


def single_stream(config, prompts: list[list[int]], max_tokens: int = SERVING_TOKENS) -> dict:
    """`none` and `draft` (CONFIG's planner, as served) answering PROMPTS one at a time, in turns, the first a warm-up;
    per drafter the means over its decode steps (steps carrying nothing beyond their token and drafts)."""
    engines = {name: Engine(config.with_drafter(name)) for name in ("none", "draft")}
    totals = {name: Counter() for name in engines}
    for index, prompt in enumerate(prompts):
        for name, engine in engines.items():
            engine.add_request(EngineRequest(f"s{index}", prompt,
                                             SamplingParams(temperature=0.0, max_tokens=max_tokens)))
            while engine.has_work:
                stats = engine.step().stats
                if index and stats.num_scheduled_tokens == 1 + stats.num_verified_draft_tokens:
                    totals[name].update(steps=1, seconds=stats.step_seconds, tokens=stats.num_generated_tokens,
                                        verified=stats.num_verified_draft_tokens, accepted=stats.num_accepted_tokens)
    rows = {name: {"tokens_per_s": round(t["tokens"] / t["seconds"], 2),
                   "ms_per_step": round(1000 * t["seconds"] / t["steps"], 3),
                   "tokens_per_step": round(t["tokens"] / t["steps"], 3),
                   "verified_per_step": round(t["verified"] / t["steps"], 3),
                   "accepted_share": round(t["accepted"] / t["verified"], 3) if t["verified"] else None}
            for name, t in totals.items()}
    none, draft = rows["none"], rows["draft"]
    added = (draft["ms_per_step"] - none["ms_per_step"]) / draft["verified_per_step"] \
        if draft["verified_per_step"] else None
    return {"questions": len(prompts) - 1, "max_new_tokens": max_tokens, "drafters": rows,
            "speedup": round(draft["tokens_per_s"] / none["tokens_per_s"], 3),
            "ms_added_per_verified_token": None if added is None else round(added, 3),
            "break_even_acceptance": None if added is None else round(added / none["ms_per_step"], 3)}


def run_step_profile(args, config, tokenizer, out_dir: Path) -> dict:
    questions = load_questions("mt-redundant", args.data_dir)
    prompts = [context_of(tokenizer, q) for q in questions[:16]]
    base = config.with_drafter("copyspec")
    config = replace(base, scheduler=replace(base.scheduler, use_goodput_planner=False, max_num_batched_tokens=4096))
    rows = [profile_case(config, prompts[:batch], verify) for batch in (1, 16) for verify in (False, True)]
    if config.model.draft_model:
        rows += [profile_case(config, prompts[:batch], False, model_draft=True) for batch in (1, 16)]
    results = {"benchmark": "step-profile", "command": "specserve " + shlex.join(sys.argv[1:]),
               "weights": rows[0]["weights"], "threads": torch.get_num_threads(), "rows": rows,
               "row_ladder": row_ladder(config, prompts[0])}
    if config.model.draft_model and getattr(tokenizer, "chat_template", None) is not None:
        mt_bench = load_questions("mt-bench", args.data_dir)[:SERVING_PROMPTS]
        results["single_stream"] = single_stream(base, [turn_prompts(tokenizer, q, None) for q in mt_bench])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown(results))
    return results


def context_of(tokenizer, question: dict, length: int = CONTEXT_LEN) -> list[int]:
    """A turn-2 prompt of LENGTH tokens: the question, its own text repeated as the first answer, the second turn;
    as plain text where the model has no chat template (a base model such as Gemma 3 270M)."""
    filler = " ".join([question["turns"][0]] * 20)
    if getattr(tokenizer, "chat_template", None) is None:
        return list(tokenizer.encode("\n\n".join([question["turns"][0], filler, question["turns"][1]])))[-length:]
    return turn_prompts(tokenizer, question, filler)[-length:]


def markdown(results: dict) -> str:
    columns = list(results["rows"][0]["phases_ms"]) + list(results["rows"][0]["forward_ms"])
    lines = [f"# Where a step's time goes ({results['weights']} weights, {results['threads']} threads)", "",
             f"Command: `{results['command']}`", "",
             "Milliseconds, median of the repeats. The forward's wall time (unprofiled steps) is split into its "
             "operators' own times by category (profiled steps; the profiler slows them, so they are upper bounds) and "
             "what they leave: Python, transformers' module calls and dispatch. Whole layers: decoder layers run as "
             "one C++ call each (engine/model/csrc/decoder_layer.cpp), their matmuls, attention and small operators "
             "inside it; the LM head's matmul stays under matmuls.", "",
             "| batch | step | tokens | step ms | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 4)]
    for row in results["rows"]:
        values = [*row["phases_ms"].values(), *row["forward_ms"].values()]
        lines.append(f"| {row['batch']} | {row['step']} | {row['tokens']} | {row['step_ms']:.1f} | "
                     + " | ".join(f"{v:.1f}" for v in values) + " |")
    for row in results["rows"]:
        if row["step"].startswith("draft"):
            per_level, decode = row["phases_ms"]["draft"] / MODEL_DRAFT_TOKENS, row["decode_step_ms"]
            nodes = row.get("drafted_per_request", MODEL_DRAFT_TOKENS)
            per_token = row["phases_ms"]["draft"] / nodes if nodes else per_level
            lines += ["", f"Draft model at batch {row['batch']}: {per_level:.2f} ms per drafted level (a forward), "
                          f"{per_level / decode:.1%} of a decode step ({decode:.1f} ms, the same engine's, timed "
                          f"between its drafting steps); {nodes:g} drafted tokens a request (a greedy head's tree "
                          f"holds more than its {MODEL_DRAFT_TOKENS} levels): {per_token:.2f} ms, "
                          f"{per_token / decode:.1%}, per drafted token."]
    return "\n".join(lines + ladder_markdown(results.get("row_ladder"))
                     + stream_markdown(results.get("single_stream"))) + "\n"


def ladder_markdown(ladder: dict | None) -> list[str]:
    if ladder is None:
        return []
    counts = ladder["step_ms_by_drafted"]
    decode = counts[0]
    return ["", "Rows verified at batch 1 (each repeat times every count in turn; step milliseconds, median):", "",
            "| drafted tokens | " + " | ".join(str(count) for count in counts) + " |",
            "|---|" + "---|" * len(counts),
            "| step ms | " + " | ".join(f"{ms:.1f}" for ms in counts.values()) + " |",
            "| × decode | " + " | ".join(f"{ms / decode:.2f}" for ms in counts.values()) + " |", "",
            f"A verified row: {ladder['ms_per_row']:.2f} ms, {ladder['row_share_of_decode']:.1%} of a decode step "
            "(least squares over the counts from 1). A drafted token pays at batch 1 only where it is accepted more "
            "often than that share and its drafting cost's share of a decode step together."]


def stream_markdown(stream: dict | None) -> list[str]:
    if stream is None:
        return []
    lines = ["", f"Single stream, the planner on ({stream['questions']} MT-Bench questions after a warm-up, greedy, "
                 f"{stream['max_new_tokens']} tokens, `none` and `draft` in turns; decode steps):", "",
             "| drafter | tokens/s | ms a step | tokens a step | drafted tokens verified a step | accepted share |",
             "|---|---|---|---|---|---|"]
    for name, row in stream["drafters"].items():
        accepted = "–" if row["accepted_share"] is None else f"{row['accepted_share']:.2f}"
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {row['ms_per_step']:.2f} | {row['tokens_per_step']:.2f} "
                     f"| {row['verified_per_step']:.2f} | {accepted} |")
    lines += ["", f"`draft` ÷ `none`: {stream['speedup']:.2f}×."]
    if stream["ms_added_per_verified_token"] is not None:
        lines[-1] += (f" A verified drafted token adds {stream['ms_added_per_verified_token']:.2f} ms to a step "
                      f"(drafting, its row, the planner): it pays where accepted more than "
                      f"{stream['break_even_acceptance']:.0%} of the time.")
    return lines
