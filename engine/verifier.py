"""Lossless verification of a draft tree: the target's own token at every depth, drafted or not.

Walk the tree from the root (the request's last token): at each depth the target
picks its token from the distribution at the current node — the argmax when greedy,
else the inverse CDF of p at that depth's uniform — and the walk moves to the child
drafted with that token, if any; the first depth without one ends the walk with the
target's token as the bonus (or correction) token.

For point-mass candidates (copied or n-gram tokens) this is SPECTRA's multi-candidate
rule (Alg. 4) realised by one uniform per depth: Alg. 4 tries the siblings in order,
accepts s with probability p(s) and otherwise zeroes p(s) and renormalises, so it
emits s_1 with probability p(s_1), s_2 with (1 - p(s_1)) p(s_2) / (1 - p(s_1)) = p(s_2),
and any undrafted token x with p(x): every token exactly with probability p(x), which
is what sampling x ~ p and accepting the sibling equal to x does. A depth's token thus
depends on its distribution and uniform alone, never on what was drafted, so a
seeded request samples the same tokens with or without speculation. p is the
distribution plain sampling draws from (engine/sampler.py's target_probs).
"""
from __future__ import annotations

import torch

from drafters.tree import ROOT, children, depths
from engine.sampler import UniformStream, inverse_cdf_samples, target_probs
from engine.wire import SamplingParams
from scheduler.records import Verification


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


def verify_greedy(logits: torch.Tensor, draft_token_ids: list[int], draft_parents: list[int]) -> Verification:
    """logits [1 + num_draft, vocab]: row 0 at the last real token, row 1 + j at draft node j."""
    argmax = logits.argmax(dim=-1).tolist()
    return walk_tree(lambda row, depth: argmax[row], draft_token_ids, draft_parents)


def verify_sampled(
    probs: torch.Tensor, draft_token_ids: list[int], draft_parents: list[int], uniforms: list[float],
) -> Verification:
    """probs [1 + num_draft, vocab] target distributions; uniforms [max depth + 1] in (0, 1], one per depth."""
    return walk_tree(
        lambda row, depth: inverse_cdf_samples(probs[row:row + 1], [uniforms[depth]])[0],
        draft_token_ids, draft_parents,
    )


class Verifier:
    """Verifies each request's draft tree; sampled requests draw from one uniform stream each (seeded when asked)."""

    def __init__(self) -> None:
        self._streams: dict[str, UniformStream] = {}

    def verify(
        self, request_id: str, params: SamplingParams, logits: torch.Tensor, draft_token_ids: list[int],
        draft_parents: list[int],
    ) -> Verification:
        if params.greedy:
            return verify_greedy(logits, draft_token_ids, draft_parents)
        stream = self._stream(request_id, params)
        uniforms = stream.next(max(depths(draft_parents), default=0) + 1)
        result = verify_sampled(target_probs(logits, params), draft_token_ids, draft_parents, uniforms)
        stream.advance(len(result.token_ids))
        return result

    def _stream(self, request_id: str, params: SamplingParams) -> UniformStream:
        if request_id not in self._streams:
            generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
            self._streams[request_id] = UniformStream(generator)
        return self._streams[request_id]

    def finish(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
