"""Lossless verification of a draft tree: the target's own token at every depth, drafted or not.

Walk the tree from the root (the request's last token): at each depth the target picks its token from p at the current
node (the argmax when greedy, else the inverse CDF of p at that depth's uniform; p as plain sampling draws it,
engine/sampler.py's target_probs) and moves to the child drafted with that token; the first depth without one ends the
walk with the target's token as the bonus token. For point-mass candidates (copied or n-gram tokens) this is SPECTRA's
multi-candidate rule (Alg. 4) with one uniform per depth: Alg. 4 emits every token x with probability p(x), as sampling
x ~ p and accepting the sibling equal to x does. A depth's token thus depends on its distribution and uniform alone,
so a seeded request samples the same tokens with or without speculation.
A chain sampled from a draft model's q is verified by speculative sampling (Leviathan et al. 2023; Chen et al. 2023):
the drafted x is accepted with probability min(1, p(x)/q(x)), else the token is drawn from the residual (p - q)+ and
the walk ends; the accept test draws from a second uniform stream per request, so a seeded request with the same drafts
samples the same tokens; greedy requests ignore q. A request that changes its logits (penalties, bias, grammar) or asks
for log-probabilities is walked one position at a time through its LogitsProcessor (engine/logits_processing.py): it
reaches a position only through the tokens plain decoding would emit, so each distribution there is plain decoding's.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from drafters.tree import ROOT, chain_parents, children, depths
from engine.grammar import Grammars
from engine.logits_processing import LogitsProcessor
from engine.logprobs import token_logprob
from engine.sampler import UniformStream, greedy_tokens, inverse_cdf_samples, sample_tokens, target_probs
from engine.wire import SamplingParams, TokenLogprob
from scheduler.records import Verification
from scheduler.request import Request

ACCEPT_SEED_OFFSET = 0xACCE97  # a seeded request's accept tests draw from a generator seeded apart from its samples


def walk_tree(choose, draft_token_ids: list[int], draft_parents: list[int]) -> Verification:
    """Walk the tree; choose(row, depth) -> the target's token at logits row `row` (0 = root, 1 + j = draft node j)."""
    kids = children(draft_parents)
    node, tokens, accepted = ROOT, [], []
    while True:
        token = choose(node + 1, len(tokens))
        tokens.append(token)
        child = next((c for c in kids.get(node, ()) if draft_token_ids[c] == token), None)
        if child is None:
            return Verification(tokens, accepted)
        accepted.append(child)
        node = child


def verify_greedy(argmax: list[int], draft_token_ids: list[int], draft_parents: list[int]) -> Verification:
    """argmax [1 + num_draft]: the target's token at row 0 (the last real token) and at row 1 + j (draft node j)."""
    return walk_tree(lambda row, depth: argmax[row], draft_token_ids, draft_parents)


def verify_sampled(
    logits: torch.Tensor, draft_token_ids: list[int], draft_parents: list[int], params: SamplingParams,
    uniforms: list[float],
) -> Verification:
    """logits [1 + num drafted, vocab]; at each row the walk reaches, the target's token drawn from `target_probs` at
    its depth's uniform (a tree's other rows are never sampled); uniforms [max depth + 1] in (0, 1], one per depth."""
    return walk_tree(
        lambda row, depth: sample_tokens(logits[row:row + 1], params, [uniforms[depth]])[0],
        draft_token_ids, draft_parents,
    )


def walk_residual(
    target: Callable[[int], torch.Tensor], draft_token_ids: list[int], draft_probs: torch.Tensor,
    uniforms: list[float], accept_uniforms: list[float], emit: Callable[[int], None],
) -> Verification:
    """Walk a chain sampled from q. target(row) -> p at logits row `row` (0 = the last real token, 1 + j = drafted
    token j); draft_probs [num drafted, vocab] q; uniforms and accept_uniforms [num drafted + 1] in (0, 1];
    emit(token) is told each emitted token in order (before the next row's p is asked for)."""
    tokens, accepted = [], []
    for depth, token in enumerate(draft_token_ids):
        p, q = target(depth), draft_probs[depth]
        if accept_uniforms[depth] * float(q[token]) <= float(p[token]):
            tokens.append(token)
            accepted.append(depth)
            emit(token)
            continue
        residual = (p - q).clamp_min(0.0)
        token = inverse_cdf_samples((residual if residual.sum() > 0 else p)[None], [uniforms[depth]])[0]  # 0: rounding
        emit(token)
        return Verification(tokens + [token], accepted)
    p = target(len(draft_token_ids))
    token = inverse_cdf_samples(p[None], [uniforms[len(draft_token_ids)]])[0]
    emit(token)
    return Verification(tokens + [token], accepted)


def processed_chooser(
    processor: LogitsProcessor, logits: torch.Tensor, uniforms: list[float] | None, logprobs: list[TokenLogprob],
):
    """choose(row, depth) for walk_tree over processed logits; appends each emitted token's logprob if asked."""
    params = processor.params

    def choose(row: int, depth: int) -> int:
        processed = processor.apply(logits[row])
        if params.greedy:
            token = int(processed.argmax())
        else:
            token = sample_tokens(processed[None], params, [uniforms[depth]])[0]
        if params.logprobs is not None:
            logprobs.append(token_logprob(processed, token, params))
        processor.emit(token)
        return token

    return choose


class Verifier:
    """Verifies each request's draft tree; sampled requests draw from one uniform stream each (seeded when asked)."""

    def __init__(self, grammars: Grammars) -> None:
        self._streams: dict[str, UniformStream] = {}
        self._accept_streams: dict[str, UniformStream] = {}  # model drafts' accept tests
        self.grammars = grammars

    def verify(
        self, req: Request, logits: torch.Tensor, draft_token_ids: list[int], draft_parents: list[int],
        draft_probs: torch.Tensor | None = None,
    ) -> tuple[Verification, list[TokenLogprob] | None]:
        """The walk's result, and the emitted tokens' log-probabilities when the request asked for them.
        DRAFT_PROBS: [num drafted, vocab] q of a chain sampled from a draft model; None for point masses."""
        params = req.sampling
        uniforms = None if params.greedy else self._stream(self._streams, req.request_id, params.seed).next(
            max(depths(draft_parents), default=0) + 1
        )
        if draft_probs is not None and not params.greedy:
            result, logprobs = self._verify_model_draft(
                req, logits, draft_token_ids, draft_parents, draft_probs, uniforms
            )
        elif params.processes_logits or params.logprobs is not None:
            logprobs: list[TokenLogprob] = []
            processor = LogitsProcessor(req, self.grammars)
            result = walk_tree(processed_chooser(processor, logits, uniforms, logprobs), draft_token_ids, draft_parents)
        else:
            logprobs = None
            result = self._verify_plain(logits, draft_token_ids, draft_parents, params, uniforms)
        if uniforms is not None:
            self._streams[req.request_id].advance(len(result.token_ids))
        return result, logprobs if params.logprobs is not None else None

    def _verify_model_draft(
        self, req: Request, logits: torch.Tensor, draft_token_ids: list[int], draft_parents: list[int],
        draft_probs: torch.Tensor, uniforms: list[float],
    ) -> tuple[Verification, list[TokenLogprob]]:
        if draft_parents != chain_parents(len(draft_parents)):
            raise ValueError("drafts sampled from a draft model are chains")
        params, logprobs = req.sampling, []
        seed = None if params.seed is None else params.seed + ACCEPT_SEED_OFFSET
        accept_uniforms = self._stream(self._accept_streams, req.request_id, seed).next(len(uniforms))
        processor = (LogitsProcessor(req, self.grammars) if params.processes_logits or params.logprobs is not None
                     else None)
        processed_rows = []

        def target(row: int) -> torch.Tensor:
            processed_rows.append(processor.apply(logits[row]) if processor else logits[row])
            return target_probs(processed_rows[-1][None], params)[0]

        def emit(token: int) -> None:
            if processor:
                if params.logprobs is not None:
                    logprobs.append(token_logprob(processed_rows[-1], token, params))
                processor.emit(token)

        result = walk_residual(target, draft_token_ids, draft_probs, uniforms, accept_uniforms, emit)
        self._accept_streams[req.request_id].advance(len(result.token_ids))
        return result, logprobs

    def uniforms(self, req: Request, draft_parents: list[int]) -> list[float]:
        """A sampled request's uniforms of its next positions, one per depth of its draft tree (drawn once: `verify`
        and `verify_chosen` use the same ones)."""
        stream = self._stream(self._streams, req.request_id, req.sampling.seed)
        return stream.next(max(depths(draft_parents), default=0) + 1)

    def verify_chosen(
        self, req: Request, tokens: list[int], draft_token_ids: list[int], draft_parents: list[int],
    ) -> Verification:
        """The walk over the tokens the runner chose at each logits row (`RowChoice`: the argmax, or the inverse CDF
        of p at the row's depth's uniform, exactly what `verify` computes row by row)."""
        result = walk_tree(lambda row, depth: tokens[row], draft_token_ids, draft_parents)
        if not req.sampling.greedy:
            self._streams[req.request_id].advance(len(result.token_ids))
        return result

    @staticmethod
    def _verify_plain(
        logits: torch.Tensor, draft_token_ids: list[int], draft_parents: list[int], params: SamplingParams,
        uniforms: list[float] | None,
    ) -> Verification:
        if params.greedy:
            return verify_greedy(greedy_tokens(logits), draft_token_ids, draft_parents)
        return verify_sampled(logits, draft_token_ids, draft_parents, params, uniforms)

    @staticmethod
    def _stream(streams: dict[str, UniformStream], request_id: str, seed: int | None) -> UniformStream:
        if request_id not in streams:
            streams[request_id] = UniformStream(None if seed is None else torch.Generator().manual_seed(seed))
        return streams[request_id]

    def finish(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._accept_streams.pop(request_id, None)
        self.grammars.finish(request_id)
