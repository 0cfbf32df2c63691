"""Drafting with an EAGLE-3 head (`--drafter draft` when `--draft-model` is a head; engine/model/eagle3.py).

A head drafts as a draft model does (drafters/model_draft.py: the scheduler's budget per request, one packed forward
per drafted position, q kept for the verifier) but each token it reads comes with a state: for the request's real
tokens the target's own hidden states at the three layers the head names, captured in the target's forward (`observe`)
and fused by the head only when it reads them (a head the planner keeps off costs no fusing); for a drafted token the
head's own output at the position before. Its entry for the token at position p reads the state at p - 1, so each
round first computes the real tokens the head has not yet read with the target's states (the tokens accepted last
step, or a whole prompt), whose last output drafts the first token.

Drafted tokens' entries read the head's states, not the target's: when the target accepts them, the next round
computes them again with the target's (as vLLM does), so the head's KV only ever holds real tokens read with the
target's states. A state the head needs and does not have (a session resumed past where its states were kept, a prompt
prefix served from the KV cache) reads zeros, which can cost acceptance, never exactness.

A greedy request's draft is a tree (EAGLE-2's dynamic tree, `HeadTree`): each forward after the first expands the
likeliest paths' ends at the newest depth in one span of rows (TREE_WIDTH shared by the round's greedy requests, one
each at least; each row seeing the real tokens and its own ancestors), each expanded node's CHILDREN likeliest tokens
become its children, and the draft is the whole tree's likeliest nodes, as many as a chain of the budget with its
siblings has. On the first 5 MT-Bench questions with the planner off (5 levels, 15 nodes) the shipped head's mean
acceptance length is 2.15 this way, 1.89 as a chain with two siblings a level. Where the head's forward lays out no
tree spans (its packed-runner path), the tree is that chain with the next SIBLINGS tokens beside each of its tokens,
which cost the head nothing more. Each node carries the head's own probability of its token given its parent as its
acceptance estimate (EAGLE-2's observation, which holds for the shipped head: on MT-Bench, first drafted tokens the
head gave 0.1-0.2 were accepted 14 % of the time, 0.5-0.6 51 %, 0.9-1.0 93 %; the planner's calibration corrects the
rest), so the planner verifies the tokens the head is sure of, and a tree grows only where its paths' probabilities
are worth another head forward (the scheduler's `continuing`). A sampled request drafts a chain as deep as the planner
says: its tokens are draws from q, and the verifier's min(1, p/q) rule is a chain's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from drafters.base import CaptureSpec, Computed, Draft, DraftableRequest, common_prefix_len
from drafters.model_draft import ModelDrafter
from drafters.tree import ROOT, TreeRows

# the head's next most likely tokens offered beside each token a greedy request drafts (EAGLE-2 expands its top 8-10
# at the GPU's almost free rows; on a CPU a verified row costs ~8 % of a step, so only the likeliest few can pay)
SIBLINGS = 2
# a greedy request's tree (`HeadTree`): the nodes it expands at each depth, its likeliest paths' ends, and the children
# each expanded node offers, its likeliest tokens (EAGLE-2 expands 8-10 of 10 on a GPU, for 60 nodes; for the 15 nodes
# of a tree 5 deep, planner off, on MT-Bench: acceptance length 1.89 at width 1 with 3 children, 2.06 at 3 with 3, 2.11
# at 3-4 with 4, 2.15 at 5 with 5, no more at 6-8). The ends a forward expands are shared by the round's greedy
# requests, one each at least: a head row costs ~0.2 ms here, so at B = 16 five ends each made a fixed-k round of 5
# levels take 68 ms beside a 60 ms decode step
TREE_WIDTH = 5
CHILDREN = 5


@dataclass
class HeadKV:
    """What the head holds of a request's real tokens. The target's states arrive every step, read or not (a head the
    planner keeps off reads none for a while): they are kept as the chunks they came in, joined only when read, so a
    step costs the same whatever the unread history's length."""

    num_valid: int = 0  # positions whose head KV holds the request's real tokens read with the target's states
    token_ids: list[int] = field(default_factory=list)  # those tokens, when a turn ends (what a next turn shares)
    states_start: int = 0  # position of the first kept state
    chunks: list[torch.Tensor] = field(default_factory=list)  # [n, 3 * hidden] target states from states_start on
    num_states: int = 0  # rows in chunks

    @property
    def num_bytes(self) -> int:
        """Bytes of the kept states (asked twice a step: the chunks share one row width and type)."""
        return self.num_states * self.chunks[0].shape[-1] * self.chunks[0].element_size() if self.chunks else 0

    def add_states(self, start: int, states: torch.Tensor) -> None:
        """The target's states of positions START.. (a step's or a chunk's, in order)."""
        if start != self.states_start + self.num_states:
            self.states_start, self.chunks, self.num_states = start, [], 0
        self.chunks.append(states)
        self.num_states += len(states)

    def read_by(self, start: int, end: int, width: int) -> torch.Tensor:
        """[end - start, width] the states the entries of positions START..END-1 read: each the state at p - 1,
        zeros where none is kept."""
        out = torch.zeros(end - start, width)
        first = max(start - 1, self.states_start)  # positions of the states read, first..last-1
        last = min(end - 1, self.states_start + self.num_states)
        if first < last:
            states = self._joined()
            out[first + 1 - start:last + 1 - start] = states[first - self.states_start:last - self.states_start]
        return out

    def keep_from(self, position: int) -> None:
        """Forget the states of positions before POSITION: read already."""
        if not self.chunks or position <= self.states_start:
            return
        kept = self._joined()[position - self.states_start:]
        self.chunks, self.num_states, self.states_start = ([kept] if len(kept) else []), len(kept), position

    def _joined(self) -> torch.Tensor:
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks)]
        return self.chunks[0]


@dataclass
class TreeNode:
    token: int
    parent: int  # index among the tree's nodes; -1: the request's last token
    probability: float  # the head's, given its parent
    path: float  # the product of the probabilities from the root
    depth: int
    slot: int = -1  # the table position its KV is written at, once expanded
    output: torch.Tensor | None = None  # [1, hidden] the head's output at its row, once expanded: its children read it


class HeadTree:
    """A greedy request's draft as the head grows it (EAGLE-2's dynamic tree): each forward expands the WIDTH
    likeliest paths' ends of the newest depth, whose rows see the request's real tokens and their own ancestors, and
    each expanded row's CHILDREN likeliest tokens become its children; the draft is the likeliest nodes of the
    whole tree, as many as a chain with its siblings would have (parents first, as a path's probability never exceeds
    its parent's). Rows sit at their depth's position and write their KV at slots of their own past the real tokens,
    ROOM - CONTEXT of them."""

    def __init__(self, context: int, depth: int, width: int, room: int, target_ids: torch.Tensor) -> None:
        self.context, self.depth, self.width, self.room, self.target_ids = context, depth, width, room, target_ids
        self.nodes: list[TreeNode] = []
        self._expanded = [ROOT]  # the nodes the last forward's rows fed (the root: the request's last real token)
        self._newest: list[int] = []
        self._root_output: torch.Tensor | None = None
        self._slots_used = 0

    def grow(self, logits: torch.Tensor, outputs: torch.Tensor) -> int:
        """The last forward's LOGITS [rows, draft vocab] and OUTPUTS [rows, hidden], one row per node it fed, each
        row's likeliest tokens as that node's children; returns the likeliest child's token."""
        top = torch.softmax(logits.float(), dim=-1).topk(min(CHILDREN, logits.shape[-1]))
        self._newest = []
        for parent, values, indices, output in zip(self._expanded, top.values.tolist(), top.indices, outputs):
            if parent == ROOT:
                self._root_output = output[None]
            else:
                self.nodes[parent].output = output[None]
            base, depth = (1.0, 1) if parent == ROOT else (self.nodes[parent].path, self.nodes[parent].depth + 1)
            for token, probability in zip(self.target_ids[indices].tolist(), values):
                self._newest.append(len(self.nodes))
                self.nodes.append(TreeNode(token, parent, probability, base * probability, depth))
        return self.nodes[self._newest[0]].token

    def candidates(self) -> list[int]:
        """The newest nodes worth expanding, likeliest first: WIDTH at most, none at the last depth or past the slots
        the request has."""
        if not self._newest or self.nodes[self._newest[0]].depth >= self.depth:
            return []
        width = min(self.width, self.room - self.context - self._slots_used)
        return sorted(self._newest, key=lambda node: -self.nodes[node].path)[:max(width, 0)]

    def expand(self, chosen: list[int]) -> tuple[tuple[list[int], int], TreeRows, torch.Tensor]:
        """((token ids, position), their rows' layout, [rows, hidden] what they read) of a forward feeding CHOSEN."""
        position = self.context + self.nodes[chosen[0]].depth - 1
        sees = []
        for node in chosen:
            self.nodes[node].slot = self.context + self._slots_used
            self._slots_used += 1
            sees.append(self._ancestor_slots(node))
        self._expanded = chosen
        features = torch.cat([self._parent_output(node) for node in chosen])
        rows = TreeRows([position] * len(chosen), [self.nodes[node].slot for node in chosen], self.context, sees)
        return ([self.nodes[node].token for node in chosen], position), rows, features

    def draft(self, size: int) -> tuple[list[int], list[int], list[float]]:
        """(tokens, parents, the head's probability of each given its parent) of the SIZE likeliest nodes."""
        ranked = sorted(range(len(self.nodes)), key=lambda n: (-self.nodes[n].path, self.nodes[n].depth, n))
        kept = set(ranked[:size])
        for node in list(kept):  # a tie can rank a child before its parent
            while self.nodes[node].parent != ROOT and self.nodes[node].parent not in kept:
                node = self.nodes[node].parent
                kept.add(node)
        order = sorted(kept, key=lambda n: (self.nodes[n].depth, n))
        index = {node: i for i, node in enumerate(order)}
        parents = [index[self.nodes[n].parent] if self.nodes[n].parent != ROOT else ROOT for n in order]
        return [self.nodes[n].token for n in order], parents, [self.nodes[n].probability for n in order]

    @property
    def forwards(self) -> int:
        """The forwards that grew the tree: one a depth, the kept nodes' or not."""
        return max((node.depth for node in self.nodes), default=0)

    def _ancestor_slots(self, node: int) -> list[int]:
        slots = []
        while node != ROOT:
            slots.append(self.nodes[node].slot)
            node = self.nodes[node].parent
        return slots

    def _parent_output(self, node: int) -> torch.Tensor:
        parent = self.nodes[node].parent
        return self._root_output if parent == ROOT else self.nodes[parent].output


class HeadDrafter(ModelDrafter):
    """A draft model's drafter whose model is a head: the target's states in, the head's own states carried from one
    drafted position to the next."""

    def __init__(self, forward, max_tokens: int, companion=None, tables: dict[bool, object] | None = None) -> None:
        super().__init__(forward, max_tokens, companion, tables)
        self.captures: CaptureSpec = forward.captures
        self._kv: dict[str, HeadKV] = {}
        self._siblings: dict[str, list[list[int]]] = {}  # per request drafting this round, per drafted token
        # a greedy request's tree this round: (tokens, parents, estimates, forwards that grew it)
        self._trees: dict[str, tuple[list[int], list[int], list[float], int]] = {}
        # per request drafting this round, per drafted token: the estimate of its acceptance given its parent's (a
        # greedy request's head probability of it, then of its siblings; with a companion, SV's estimate of it alone)
        self._confidence: dict[str, list[list[float]]] = {}

    def begin(self, req: DraftableRequest, state: object | None = None) -> None:
        """A session's next turn keeps what the head computed of the prefix it shares with the history and whose KV
        the cache kept."""
        super().begin(req)
        kv = state if isinstance(state, HeadKV) else HeadKV()
        shared = common_prefix_len(kv.token_ids, req.all_token_ids)
        kv.num_valid = min(kv.num_valid, shared, req.num_computed_tokens)
        self._kv[req.request_id] = kv

    def observe(self, req: DraftableRequest, computed: Computed) -> None:
        if computed.hidden_states is not None and len(computed.token_ids):
            self._kv[req.request_id].add_states(computed.start, computed.hidden_states)

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        """Drafted entries are never kept (the next round reads the accepted tokens with the target's states); the
        companion's table learns each outcome."""
        state = self._states[req.request_id]
        self._learn(req, state, new_token_ids)
        state.fed, state.drafted, state.scores = [], [], []

    def preempt(self, req: DraftableRequest) -> None:
        self._kv[req.request_id] = HeadKV()

    def finish(self, req: DraftableRequest) -> HeadKV | None:
        self._states.pop(req.request_id, None)
        kv = self._kv.pop(req.request_id, None)
        if kv is not None:
            kv.token_ids = list(req.all_token_ids[:kv.num_valid])
        return kv

    def state_bytes(self) -> int:
        return super().state_bytes() + sum(kv.num_bytes for kv in self._kv.values())

    def _draft(
        self, drafting: list[DraftableRequest], budgets: dict[str, int],
    ) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
        """The first forward reads each request's unread real tokens with the target's states (fused in one call for
        the whole round); each next one a drafted token per chain with the head's output before it, or a greedy
        request's tree nodes at the next depth (`HeadTree`). A companion head runs the same chains beside it, reading
        the same target states and its own outputs, and scores each drafted token."""
        drafted: dict[str, list[int]] = {req.request_id: [] for req in drafting}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req in drafting}
        self._siblings, self._confidence, self._trees = {}, {}, {}
        if not drafting:  # a resting head's step
            return drafted, probs
        for req in drafting:
            self._states[req.request_id].scores = []
        chains, states = zip(*map(self._catch_up, drafting)) if drafting else ((), ())
        greedy = [req for req in drafting if self._grows_tree(req)]
        width = max(TREE_WIDTH // max(len(greedy), 1), 1)
        trees = {req.request_id: self._new_tree(req, budgets[req.request_id], width) for req in greedy}
        rows = [None] * len(chains)
        features = self._fused(self.forward, states)
        scoring = self.companion.forward if self.companion and chains else None
        companion_features = self._fused(scoring, states) if scoring else ()
        while chains:
            logits, outputs = self.forward.run(list(chains), list(features), rows)
            tokens = [trees[req.request_id].grow(row, output) if req.request_id in trees
                      else self._take(req, row[0], drafted, probs)
                      for req, row, output in zip(drafting, logits, outputs)]
            if scoring:
                scores, companion_outputs = scoring.run(list(chains), list(companion_features))
                for req, token, row in zip(drafting, tokens, scores):
                    self._score(req, probs[req.request_id][-1], row[0], token)
            candidates = [(i, node) for i, req in enumerate(drafting) for node in self._candidates(req, trees, drafted,
                                                                                                  budgets)]
            going = self.forward.continuing([self._candidate_probability(drafting[i], node, trees)
                                             for i, node in candidates])
            chosen: dict[int, list[int]] = {}
            for (i, node), goes in zip(candidates, going):
                if goes:
                    chosen.setdefault(i, []).append(node)
            chains, features, rows, companion_features = [], [], [], []
            for i, nodes in chosen.items():
                req = drafting[i]
                if req.request_id in trees:
                    chain, tree_rows, feature = trees[req.request_id].expand(nodes)
                    chains.append((req.request_id, *chain))
                    rows.append(tree_rows)
                    features.append(feature)
                    continue
                chains.append((req.request_id, [tokens[i]], len(req.all_token_ids) + len(drafted[req.request_id]) - 1))
                rows.append(None)
                features.append(outputs[i])
                if scoring:
                    companion_features.append(companion_outputs[i])
            drafting = [drafting[i] for i in chosen]
        for request_id, tree in trees.items():
            self._trees[request_id] = (*tree.draft((1 + SIBLINGS) * budgets[request_id]), tree.forwards)
            drafted[request_id] = self._trees[request_id][0]
        return drafted, probs

    def _grows_tree(self, req: DraftableRequest) -> bool:
        """A greedy request drafts a tree where the head's forward lays tree spans out and no companion scores it."""
        return req.sampling.greedy and not self.companion and self.forward.drafts_trees

    def _new_tree(self, req: DraftableRequest, budget: int, width: int) -> HeadTree:
        context = len(req.all_token_ids)
        room = self.forward.make_room(req.request_id, context + width * max(budget - 1, 0))
        return HeadTree(context, budget, width, room, self.forward.target_ids)

    def _candidates(
        self, req: DraftableRequest, trees: dict[str, HeadTree], drafted: dict[str, list[int]], budgets: dict[str, int],
    ) -> list[int]:
        """What of the request could draft one more forward: a tree's nodes to expand, or a chain's last token (0)."""
        if req.request_id in trees:
            return trees[req.request_id].candidates()
        return [0] if len(drafted[req.request_id]) < budgets[req.request_id] else []

    def _candidate_probability(self, req: DraftableRequest, node: int, trees: dict[str, HeadTree]) -> float:
        tree = trees.get(req.request_id)
        return tree.nodes[node].path if tree is not None else self._path_probability(req)

    @staticmethod
    def _fused(forward, states: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Per chain, what its tokens read: the target's STATES through FORWARD's head, fused in one call."""
        return forward.fuse(torch.cat(states)).split([len(s) for s in states]) if states else ()

    def _score(self, req: DraftableRequest, q: torch.Tensor, companion_logits: torch.Tensor, token: int) -> None:
        """SV's observation of a drafted TOKEN (q: its draft distribution over the target's vocabulary) against the
        companion's distribution c, and its acceptance estimate: the companion table's where one is calibrated
        (`specserve calibrate sv`), else A itself. c is 0 outside the companion's draft vocabulary, so both sums run
        over that vocabulary alone: S = sum min(q, c) there, A = min(1, c(x) / q(x))."""
        companion = self.companion.forward
        c = companion.probs(companion_logits, req.sampling)  # processed over its draft vocabulary: -inf elsewhere
        s = float(torch.minimum(q[companion.target_ids], c).sum())
        draft_id = int(companion.draft_ids[token])
        a = min(1.0, float(c[draft_id]) / max(float(q[token]), 1e-12)) if draft_id >= 0 else 0.0
        self._states[req.request_id].scores.append((s, a))
        table = self.tables.get(req.sampling.greedy)
        self._confidence.setdefault(req.request_id, []).append([table.estimate(s, a) if table is not None else a])

    def _companion_estimates(self, reqs: list[DraftableRequest]) -> dict[str, list[float]]:
        """Per request, the estimates its drafted tokens were scored with as they were drafted (with a companion)."""
        if self.companion is None:
            return {}
        return {req.request_id: [level[0] for level in self._confidence[req.request_id]] for req in reqs}

    def _path_probability(self, req: DraftableRequest) -> float:
        """The estimated probability that the request's whole chain so far is accepted: the head's probability of it
        (1 for a sampled request without a companion: its tokens are draws, their acceptance is not their
        probability), or SV's estimates with a companion."""
        return math.prod(level[0] for level in self._confidence.get(req.request_id, ()))

    def _draw(self, req: DraftableRequest, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """As a draft model draws from LOGITS [draft vocab], widened to the target's vocabulary only where q is
        asked: a greedy request without a companion takes the draft argmax's target id, and keeps the next SIBLINGS
        as its siblings."""
        if req.sampling.greedy and not self.companion:
            top = torch.softmax(logits.float(), dim=-1).topk(min(1 + SIBLINGS, len(logits)))
            token, *siblings = self.forward.target_ids[top.indices].tolist()
            self._siblings.setdefault(req.request_id, []).append(siblings)
            self._confidence.setdefault(req.request_id, []).append(top.values.tolist())
            return token, None
        return super()._draw(req, self.forward.target_logits(logits))

    def _as_draft(self, req: DraftableRequest, token_ids: list[int], acceptance: list[float] | None) -> Draft:
        """The chain TOKEN_IDS with each token's siblings beside it (parents first) and the head's probability of each
        node, where the request kept them (a greedy request)."""
        if req.request_id in self._trees:
            tree, parents, confidence, forwards = self._trees[req.request_id]
            return Draft(tree, self.name, parents, acceptance=confidence, forwards=forwards)
        siblings = self._siblings.get(req.request_id)
        if not siblings or acceptance is not None:
            return super()._as_draft(req, token_ids, acceptance)
        tree, parents, parent = [], [], -1
        for token, others in zip(token_ids, siblings):
            tree += [token, *others]
            parents += [parent] * (1 + len(others))
            parent = len(tree) - 1 - len(others)
        confidence = [q for level in self._confidence[req.request_id] for q in level]
        return Draft(tree, self.name, parents, acceptance=confidence)

    def _unread(self, req: DraftableRequest) -> int:
        return len(req.all_token_ids) - self._kv[req.request_id].num_valid

    def _catch_up(self, req: DraftableRequest) -> tuple[tuple[str, list[int], int], torch.Tensor]:
        """The chain of the request's tokens the head has not read, and the target's states they read (unfused)."""
        kv, end = self._kv[req.request_id], len(req.all_token_ids)
        start = min(kv.num_valid, end - 1)
        chain = (req.request_id, list(req.all_token_ids[start:end]), start)
        states = kv.read_by(start, end, self.forward.state_size)
        kv.num_valid = end
        kv.keep_from(end - 1)
        return chain, states

