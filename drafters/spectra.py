"""SPECTRA (Le et al. 2025, "SPECTRA: Faster LLM Inference with Optimized Internal and External
Speculation", Algorithm 1): guesses from two n-gram dictionaries of the conversation, searched both ways.

- The forward dictionary maps a token to its recent continuations of up to N - 1 tokens: a list per token, capped
  at PER_KEY_CAP and least recently written dropped first (the paper's "W = 15 maintained per key", read as a cap
  per key, and the 15 pool chains as W). A continuation that extends one already listed replaces it, and one that is
  a prefix of a listed one refreshes it, so a list holds distinct continuations, not the prefixes of one.
- The backward dictionary maps a context of 1 .. N - 1 tokens to the token that followed it, the latest write
  winning.

Both are fed with every token the target computes (each window of N tokens of the conversation, as the paper feeds
them with the candidate pool's chains, Algorithm 1 lines 35-41) and with every chain of N tokens `add_chain` is
given (the candidate pool's, advanced through look-ahead rows).

Guesses (lines 7-17): the backward guess first, the forward dictionary's continuations of the last token after it,
most recent first, at most G in all (the notes: Algorithm 1 appends the backward guess last and then truncates to G,
which loses it whenever the forward list is full). The backward guess is built a token at a time, each from the
longest context of the conversation and the guess so far that the backward dictionary knows, up to BACKWARD_TOKENS
(the paper: N); its kind names how long its first token's context was (MT-Bench, greedy: right 0.16 of the time
after 1 token, 0.37 after 2, 0.53 after 3, 0.77 after 4; one kind for all would price a copy and a guess alike). The
guesses are merged into one tree (drafters/tree.py) whose every node carries, for the goodput planner, the running
acceptance of its kind at its depth (drafters/ngram.py's RowRates): a node's kind is the first guess through it, and
whether other guesses agree on it (`node_kinds`). Nodes are scored, not guesses (a guess of one kind that agrees
with an earlier one is right far more often than one that branches off alone), and each request's own rates count
first, shrunk towards those of every request: how often the backward guess is right differs from one question to the
next (MT-Bench: 0.28 on some, 0.58 on others), so rates over all requests alone lag behind and misprice the rows.
Sessions carry the dictionaries from one turn of a conversation to the next (drafters/corpus.py).

Beyond the paper, the model bigram (drafters/bigram.py: the target's own top next tokens after the last token alone,
each extended by its argmax) can fill `--spectra-bigram-rows` more rows after the others, as the n-gram paper's mixed
strategy fills its rows: where every guess is verified 5 rows raise MT-Bench's tokens per call from 2.23 to 2.38, but
with the goodput planner on, which verifies them rarely (3-8 % accepted at depth 1), the host time of building and
pricing them costs more than they add on this CPU (greedy, planner on: 1.25 / 1.24 / 1.19x `none` with them, 1.29 /
1.28 / 1.21x without, MT-Bench / HumanEval / GSM8K), so by default there are none.

SPECTRA-RETRIEVAL's guesses follow the core's: the continuations of the context's end in two retrieval indexes
(drafters/retrieval.py), the server's own traffic first (every finished response, behind the last tokens of its
prompt, joins one index shared by all requests and sessions, bounded in bytes, oldest out: `--spectra-index-mib`),
then the corpus `specserve calibrate corpus` kept for the served model (the paper's index: the samples the model finds
likeliest), then one guess from the same calibration's table of the model's own confident next tokens after short
contexts (drafters/model_ngrams.py: what is guessable in sampled text, where the conversation's n-grams rarely are);
a request resting from proposing (scheduler/drafting_gate.py) offers that guess alone. `spectra-core` is the core
alone.

Defaults are the paper's Appendix B: N = 5 (5-grams), G = 15 guesses, 15 continuations per key, W = 15 pool
chains; tau is read the other way round (TAU).
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from drafters.base import TOKEN_BYTES, Computed, Draft, DraftableRequest, common_prefix_len, follow_longest_contexts
from drafters.corpus import CorpusDrafter, SessionCorpus
from drafters.model_ngrams import ModelNgrams
from drafters.model_ngrams import kind as model_kind
from drafters.ngram import RowRates
from drafters.retrieval import MAX_MATCH, SuffixIndex
from drafters.tree import Trie, chain_parents, depths, scored_walk

if TYPE_CHECKING:
    import torch

    from drafters.bigram import BackgroundTable

NGRAM = 5  # N: the longest n-gram the dictionaries hold
MAX_GUESSES = 15  # G
PER_KEY_CAP = 15  # continuations the forward dictionary keeps per token
POOL_SIZE = 15  # W: chains in the candidate pool
# the backward guess runs on while the backward dictionary knows a next token, up to this many tokens: the paper stops
# at N; replaying `none`'s greedy answers (20 questions a set, no pool), tokens per call with every guess verified
# rise with it, MT-Bench / HumanEval / GSM8K 1.81 / 2.26 / 2.32 at 5, 1.91 / 2.42 / 2.42 at 12, 1.93 / 2.45 / 2.43
# at 16, 1.96 / 2.48 / 2.43 at 32; the planner prices each deeper token by its kind's rate at that depth
BACKWARD_TOKENS = 16
# the pool's refine threshold: a chain takes a token the forward dictionary lacks when r > tau, r ~ U(0, 1). The
# paper's 0.1 as written refines 90 % of the time; here tokens per call fell as refining grew (bench/README.md,
# SPECTRA), so the default reads the paper's 0.1 as the probability of refining: 0.9 as written
TAU = 0.9
# SPECTRA-RETRIEVAL's guesses, after the core's: the paper truncates core + retrieval to G, which drops retrieval
# whenever the forward list is full; here the planner prices every row by its kind's measured acceptance, so up to
# RETRIEVAL_GUESSES guesses of RETRIEVAL_TOKENS (CopySpec's |S|) join the tree beyond the core's G
RETRIEVAL_GUESSES = 3
RETRIEVAL_TOKENS = 10
LONG_MATCH = 8  # a retrieval guess after a match this long is scored apart from the shorter ones
LONG_RETRIEVAL_TOKENS = 32  # and may run this long: SuffixDecoding drafts further the longer the match
# a response joins the traffic index behind its prompt's last tokens: a later response's first tokens are then drafted
# from the response whose prompt ended most like its own (a match is measured back MAX_MATCH tokens)
PROMPT_TAIL_TOKENS = MAX_MATCH
DICTIONARIES = ("backward", "forward")  # both are kept up to date; the ablation drafts from one alone


class NgramDictionaries:
    """SPECTRA's forward and backward dictionaries over a growing token list (and any chains added to them)."""

    # host memory per entry (a backward context or a forward continuation): tracemalloc, CPython 3.11, 4000 uniform
    # random tokens, N = 5 (text repeats itself more, and its entries cost less: 66 bytes for Pareto-random tokens)
    BYTES_PER_ENTRY = 170

    def __init__(self, n: int = NGRAM, per_key_cap: int = PER_KEY_CAP) -> None:
        self.n = n
        self.per_key_cap = per_key_cap
        self.forward: dict[int, OrderedDict[tuple[int, ...], None]] = {}  # token -> continuations, oldest first
        self.backward: dict[tuple[int, ...], int] = {}  # context -> the token that followed it last
        self.num_indexed = 0  # tokens of the list already covered
        self.num_continuations = 0  # in all the forward lists
        # entries the candidate pool wrote and the token list has not (yet): what look-ahead rows earned
        self.pool_forward: set[tuple[int, tuple[int, ...]]] = set()
        self.pool_backward: set[tuple[int, ...]] = set()

    def extend(self, token_ids: Sequence[int]) -> None:
        """Add every window of N tokens that the tokens appended since the last call complete (shorter ones at the
        start of the list)."""
        for end in range(self.num_indexed + 1, len(token_ids) + 1):
            self.add_chain(token_ids[max(end - self.n, 0):end], last_only=True)
        self.num_indexed = len(token_ids)

    def add_chain(self, chain: Sequence[int], last_only: bool = False, from_pool: bool = False) -> None:
        """Algorithm 1's update with one chain c: forward[c_j] gets c_{j+1:}, backward[c_{0:j+1}] gets c_{j+1}.

        LAST_ONLY: the chain is a window of a token list whose shorter windows were added already, so only what
        ends at its last token is new: every forward continuation still grows by it, and the backward contexts are
        those of the last token, each suffix of the tokens before it. FROM_POOL: the candidate pool's chain."""
        chain = tuple(chain)
        for j in range(len(chain) - 1):
            self._add_continuation(chain[j], chain[j + 1:], from_pool)
            if not last_only:
                self._add_following(chain[:j + 1], chain[j + 1], from_pool)
        if last_only:
            for k in range(1, len(chain)):
                self._add_following(chain[len(chain) - 1 - k:-1], chain[-1], from_pool)

    def _add_following(self, context: tuple[int, ...], token: int, from_pool: bool) -> None:
        self.backward[context] = token
        if from_pool:
            self.pool_backward.add(context)
        else:
            self.pool_backward.discard(context)

    def _add_continuation(self, token: int, continuation: tuple[int, ...], from_pool: bool) -> None:
        """Lists CONTINUATION under TOKEN. No listed continuation is a prefix of another, so two lookups settle the
        common cases: the same one listed (it is refreshed), or the one a token shorter (as a window of the token list
        grows by a token: the new one replaces it); otherwise a scan finds one it is a prefix of (refreshed) or one
        that is a prefix of it (replaced)."""
        listed = self.forward.get(token)
        if listed is None:  # (setdefault would build an OrderedDict every call)
            listed = self.forward[token] = OrderedDict()
        if continuation in listed:
            listed.move_to_end(continuation)
            if not from_pool:
                self.pool_forward.discard((token, continuation))
            return
        if continuation[:-1] in listed:
            self._unlist(token, continuation[:-1])
        else:
            for old in listed:
                if old[:len(continuation)] == continuation:  # a longer one is listed: refresh it
                    listed.move_to_end(old)
                    return
                if continuation[:len(old)] == old:
                    self._unlist(token, old)
                    break
        listed[continuation] = None
        self.num_continuations += 1
        if from_pool:
            self.pool_forward.add((token, continuation))
        if len(listed) > self.per_key_cap:
            self._unlist(token, next(iter(listed)))  # the least recently written

    def _unlist(self, token: int, continuation: tuple[int, ...]) -> None:
        del self.forward[token][continuation]
        self.pool_forward.discard((token, continuation))
        self.num_continuations -= 1

    @property
    def num_bytes(self) -> int:
        return self.BYTES_PER_ENTRY * (len(self.backward) + self.num_continuations)

    def forward_guesses(self, last_token: int) -> list[tuple[list[int], bool]]:
        """The continuations of LAST_TOKEN, most recently written first, each with whether the pool wrote it."""
        return [(list(continuation), (last_token, continuation) in self.pool_forward)
                for continuation in reversed(self.forward.get(last_token, ()))]

    def backward_guess(self, token_ids: Sequence[int], max_tokens: int) -> tuple[list[int], bool, int]:
        """Up to MAX_TOKENS tokens, each the backward dictionary's next token after the longest context (of the
        list's last tokens and the guess so far) that it knows; it stops where it knows none. Also whether an entry
        the pool wrote gave any of them, and how many tokens long the context of the first one was (0: no guess)."""
        steps = follow_longest_contexts(self.backward, token_ids, self.n - 1, max_tokens)
        guess = [token for _, token in steps]
        from_pool = any(context in self.pool_backward for context, _ in steps)
        first_context = len(steps[0][0]) if steps else 0
        return guess, from_pool, first_context


class CandidatePool:
    """W chains of N - 1 tokens, advanced a token at a time through look-ahead rows (Algorithm 1 lines 25-43).

    Each chain the step carried gets its next token from the logits after its last row: the most probable token
    the forward dictionary has no entry for (among the UNSEEN_CANDIDATES most probable; past them a token is too
    unlikely to be worth a guess) with probability 1 - tau, the most probable one otherwise (the paper's
    rule as written: r ~ U(0, 1) > tau refines). The chain with that token is an n-gram for the
    dictionaries; then it shifts left by one. The chains carried go to the back of the pool, so that when the planner
    keeps only a few, every chain takes its turn. Chains start as random tokens of the request's own context."""

    UNSEEN_CANDIDATES = 16  # most probable tokens searched for one the forward dictionary lacks

    def __init__(self, context: Sequence[int], size: int, length: int, tau: float, rng: random.Random) -> None:
        self.chains = [[rng.choice(context) for _ in range(length)] for _ in range(size)]
        self.tau = tau
        self.rng = rng

    def offered(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(chain) for chain in self.chains)

    def advance(self, logits: torch.Tensor, index: NgramDictionaries) -> int:
        """Advance the first len(LOGITS) chains, writing each n-gram into INDEX; returns the rows they took."""
        carried = self.chains[:len(logits)]
        top = logits.topk(min(self.UNSEEN_CANDIDATES, logits.shape[-1]), dim=-1).indices.tolist()
        for chain, candidates in zip(carried, top):
            following = candidates[0]
            if self.rng.random() > self.tau:
                following = next((token for token in candidates if token not in index.forward), following)
            index.add_chain(chain + [following], from_pool=True)
            chain[:] = chain[1:] + [following]
        self.chains = self.chains[len(carried):] + carried
        return sum(len(chain) for chain in carried)


class LookaheadYield:
    """Tokens look-ahead rows earn, per row: over all requests, the tokens accepted from guesses the pool wrote
    beyond what the best guess the token lists wrote would have accepted, divided by the rows computed; it starts
    from PRIOR, worth PRIOR_ROWS rows, so the planner tries a few chains before it knows."""

    PRIOR = 0.1  # tokens per row: about what a row must earn to pay for itself in a CPU decode step
    PRIOR_ROWS = 64.0

    def __init__(self) -> None:
        self.earned = 0.0
        self.rows = 0

    @property
    def per_row(self) -> float:
        return (self.earned + self.PRIOR * self.PRIOR_ROWS) / (self.rows + self.PRIOR_ROWS)

    def score(self, guesses: list[Guess], target_token_ids: Sequence[int]) -> None:
        """Credit the pool with what its guesses would have accepted beyond the others'."""
        best = {True: 0, False: 0}
        for guess in guesses:
            best[guess.from_pool] = max(best[guess.from_pool], common_prefix_len(guess.token_ids, target_token_ids))
        self.earned += max(best[True] - best[False], 0)


@dataclass
class Guess:
    token_ids: list[int]
    kind: str  # its acceptance statistics' key: backward, or forward with its rank; ":pool" if the pool wrote it
    from_pool: bool


@dataclass
class Proposal:
    """A draft as the next step's tokens score it: its guesses, and the tree they merged into with each node's kind."""

    guesses: list[Guess]
    token_ids: list[int]
    parents: list[int]
    kinds: list[str]


def node_kinds(guesses: list[Guess], paths: list[list[int]], num_nodes: int) -> list[str]:
    """[num_nodes] each node's kind: the first guess through it, ":agreed" when another guess passes through it too."""
    first: list[str | None] = [None] * num_nodes
    count = [0] * num_nodes
    for guess, path in zip(guesses, paths):
        for node in path:
            count[node] += 1
            first[node] = first[node] or guess.kind
    return [f"{kind}:agreed" if n > 1 else kind for kind, n in zip(first, count)]


def retrieval_guess(source: str, token_ids: list[int], match: int) -> Guess:
    """A retrieval index's continuation after a match of MATCH tokens: LONG_RETRIEVAL_TOKENS of it after a long
    match, RETRIEVAL_TOKENS after a short one, scored by its source and the match's class."""
    if match >= LONG_MATCH:
        return Guess(token_ids[:LONG_RETRIEVAL_TOKENS], f"{source}:long", False)
    return Guess(token_ids[:RETRIEVAL_TOKENS], f"{source}:short", False)


class SpectraDrafter(CorpusDrafter[NgramDictionaries]):
    """SPECTRA: the dictionaries' guesses (SPECTRA-core), then the retrieval indexes' (TRAFFIC: every finished
    response of every request; CORPUS: the calibrated corpus; MODEL_NGRAMS: the calibration's table of the model's
    own next tokens; none of them: the core alone, `spectra-core`), as one tree per step, and the candidate pool's
    chains offered as look-ahead for the planner to carry or not."""

    name = "spectra"

    def __init__(self, n: int = NGRAM, max_guesses: int = MAX_GUESSES, pool_size: int = POOL_SIZE,
                 tau: float = TAU, per_key_cap: int = PER_KEY_CAP, seed: int = 0,
                 backward_tokens: int = BACKWARD_TOKENS,
                 traffic: SuffixIndex | None = None, corpus: SuffixIndex | None = None,
                 model_ngrams: ModelNgrams | None = None,
                 bigram: BackgroundTable | None = None, bigram_guesses: int = 0) -> None:
        super().__init__(lambda: NgramDictionaries(n, per_key_cap))
        retrieval = (traffic, corpus, model_ngrams)
        self.name = "spectra" if any(source is not None for source in retrieval) else "spectra-core"
        self.traffic = traffic
        self.corpus = corpus
        self.model_ngrams = model_ngrams
        self.bigram = bigram  # None: no bigram rows
        self.bigram_guesses = bigram_guesses
        self._prompt_lengths: dict[str, int] = {}  # request id -> its prompt's tokens (its response follows)
        self.n = n
        self.backward_tokens = backward_tokens
        self.max_guesses = max_guesses
        self.pool_size = pool_size
        self.tau = tau
        self.rng = random.Random(seed)
        self.rates = RowRates()  # over every request
        self._request_rates: dict[str, RowRates] = {}  # request id -> its own
        self.lookahead_yield = LookaheadYield()
        self._pools: dict[str, CandidatePool] = {}  # request id -> its candidate pool
        self._proposed: dict[str, Proposal] = {}  # request id -> its last draft
        self.dictionaries = frozenset(DICTIONARIES)  # those guesses are drawn from (fewer: the ablation's)

    def begin(self, req: DraftableRequest, state: SessionCorpus[NgramDictionaries] | None = None) -> None:
        super().begin(req, state)
        self._prompt_lengths[req.request_id] = len(req.all_token_ids)
        if self.pool_size:
            self._pools[req.request_id] = CandidatePool(req.all_token_ids, self.pool_size, self.n - 1, self.tau,
                                                        self.rng)

    def observe(self, req: DraftableRequest, computed: Computed) -> None:
        """The look-ahead rows' logits advance the pool's chains carried, and their n-grams join the dictionaries."""
        if computed.lookahead_logits is not None:
            pool = self._pools[req.request_id]
            self.lookahead_yield.rows += pool.advance(computed.lookahead_logits, self._corpora[req.request_id].index)

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        """The step's tokens are the target's next ones: they score the last draft's guesses, then join the
        dictionaries."""
        proposal = self._proposed.pop(req.request_id, None)
        if proposal is not None:
            walk = scored_walk(proposal.token_ids, proposal.parents, new_token_ids)
            for rates in (self.rates, self._request_rates.setdefault(req.request_id, RowRates())):
                rates.score_walk(walk, proposal.kinds)
            self.lookahead_yield.score(proposal.guesses, new_token_ids)
        super().extend(req, new_token_ids)

    def draft(self, request_id: str, corpus: SessionCorpus[NgramDictionaries]) -> Draft:
        guesses, tree, paths = self.guess_tree(corpus.index, corpus.corpus)
        kinds = node_kinds(guesses, paths, len(tree.token_ids))
        # scored against the target's tokens at the next extend
        self._proposed[request_id] = Proposal(guesses, tree.token_ids, tree.parents, kinds)
        pool = self._pools.get(request_id)
        return Draft(tree.token_ids, self.name, tree.parents, self._estimates(request_id, kinds, tree.parents),
                     lookahead=pool.offered() if pool else (), lookahead_yield=self.lookahead_yield.per_row)

    def _estimates(self, request_id: str, kinds: list[str], parents: list[int]) -> list[float]:
        """Each node's acceptance by its kind at its depth: the request's own rates first, shrunk towards all's."""
        own = self._request_rates.get(request_id, RowRates())
        return own.estimates(list(zip(kinds, depths(parents))), shared=self.rates)

    def propose_resting(self, reqs: Sequence[DraftableRequest]) -> list[Draft]:
        """A resting request's draft is the model n-grams' guess alone: one table lookup, no catching up of the
        dictionaries, no search (scored like any other at the next extend)."""
        return [self._model_ngram_draft(req.request_id, self._corpora[req.request_id].corpus) for req in reqs]

    def _model_ngram_draft(self, request_id: str, token_ids: Sequence[int]) -> Draft:
        guess = self._model_ngram_guess(token_ids)
        if not guess.token_ids:
            return Draft([], self.name)
        parents = chain_parents(len(guess.token_ids))
        kinds = [guess.kind] * len(parents)
        self._proposed[request_id] = Proposal([guess], guess.token_ids, parents, kinds)
        return Draft(guess.token_ids, self.name, parents, self._estimates(request_id, kinds, parents))

    def _model_ngram_guess(self, token_ids: Sequence[int]) -> Guess:
        """The model n-grams' guess after TOKEN_IDS, of its first token's confidence kind (no tokens: none)."""
        tokens, confidence = self.model_ngrams.guess(token_ids) if self.model_ngrams is not None else ([], 0.0)
        return Guess(tokens, model_kind(confidence), False)

    def guesses(self, index: NgramDictionaries, token_ids: Sequence[int]) -> list[Guess]:
        """The guesses `guess_tree` takes, without their tree."""
        return self.guess_tree(index, token_ids)[0]

    def guess_tree(self, index: NgramDictionaries,
                   token_ids: Sequence[int]) -> tuple[list[Guess], Trie, list[list[int]]]:
        """At most G guesses: the backward one first, then the forward ones; then the retrieval indexes', the model
        n-grams' and the model bigram's. Each joins one tree as it is taken (with its nodes there); a guess the tree
        holds already (a prefix of one taken before) adds no token and is left out."""
        candidates = []
        if "backward" in self.dictionaries:
            backward, from_pool, context = index.backward_guess(token_ids, self.backward_tokens)
            candidates.append(Guess(backward, f"backward:context{context}" + (":pool" if from_pool else ""), from_pool))
        if "forward" in self.dictionaries:
            candidates += [Guess(guess, f"forward:rank{min(rank, 3)}" + (":pool" if from_pool else ""), from_pool)
                           for rank, (guess, from_pool) in enumerate(index.forward_guesses(token_ids[-1]))]
        tree, guesses, paths = Trie(), [], []
        self._take(candidates, self.max_guesses, tree, guesses, paths)
        retrieved = [retrieval_guess(source, tokens, match)
                     for source, index in (("traffic", self.traffic), ("corpus", self.corpus)) if index is not None
                     for tokens, match in index.search(token_ids, RETRIEVAL_GUESSES, LONG_RETRIEVAL_TOKENS)]
        self._take(retrieved, len(guesses) + RETRIEVAL_GUESSES, tree, guesses, paths)
        self._take([self._model_ngram_guess(token_ids)], len(guesses) + 1, tree, guesses, paths)
        # each guess taken covers at most one bigram row (the one starting with its first token)
        bigram = self._bigram_guesses(token_ids[-1], len(guesses) + self.bigram_guesses)
        self._take(bigram, len(guesses) + self.bigram_guesses, tree, guesses, paths)
        return guesses, tree, paths

    def _bigram_guesses(self, last_token: int, count: int) -> list[Guess]:
        """The model bigram's first COUNT rows of N - 1 tokens after LAST_TOKEN (none until its table is ready)."""
        table = self.bigram.table if self.bigram is not None else None
        if table is None or not self.bigram_guesses:
            return []
        return [Guess(row, f"bigram:rank{min(rank, 3)}", False)
                for rank, row in enumerate(table.rows(last_token, count, self.n - 1))]

    @staticmethod
    def _take(candidates: list[Guess], limit: int, tree: Trie, guesses: list[Guess], paths: list[list[int]]) -> None:
        """Adds CANDIDATES to TREE (and to GUESSES, their nodes to PATHS), up to LIMIT guesses in all, leaving out
        those the tree holds already."""
        for guess in candidates:
            if len(guesses) == limit:
                break
            if guess.token_ids:
                path, grew = tree.add(guess.token_ids)
                if grew:
                    guesses.append(guess)
                    paths.append(path)

    def finish(self, req: DraftableRequest) -> SessionCorpus | None:
        """The request's response, behind its prompt's last PROMPT_TAIL_TOKENS, joins the traffic index for every
        later request to draw on."""
        self._proposed.pop(req.request_id, None)
        self._request_rates.pop(req.request_id, None)
        self._pools.pop(req.request_id, None)
        prompt_length = self._prompt_lengths.pop(req.request_id, len(req.all_token_ids))
        if self.traffic is not None:
            self.traffic.add(req.all_token_ids[max(prompt_length - PROMPT_TAIL_TOKENS, 0):])
        return super().finish(req)

    def state_bytes(self) -> int:
        pools = sum(len(pool.chains) * (self.n - 1) for pool in self._pools.values())
        indexes = sum(source.num_bytes for source in (self.traffic, self.corpus, self.model_ngrams)
                      if source is not None)
        return super().state_bytes() + TOKEN_BYTES * pools + indexes
