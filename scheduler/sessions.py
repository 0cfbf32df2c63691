"""Session caches: which KV blocks a conversation's next turn reuses, and which cached sessions give way.

A session keeps, from its last finished turn, the exact token history (the prompt as the engine received it and the
output as generated, not as a chat template would re-render it) and references to the KV blocks of the history's full
blocks, so that the next turn's prefill starts after the longest prefix it shares with the history. The engine, which
runs the drafters, keeps the drafter's state at the end of a turn (the CopySpec index, say) under the session's key:
`attach` says which key a new turn resumes, `end` which key a finished turn updated, `take_evicted_keys` which are gone.

A request names its session (`session_id`) or, in implicit mode, is matched to the session that holds its longest
cached prefix, found by chaining hashes of full blocks as prefix caching does. Sessions live in the KV pool's memory and
always give way to requests: the scheduler reclaims their blocks, least recently used first, before a request waits or
is preempted; a TTL and a cap on their number bound them too. A request holds its own references to the blocks it
reads, so evicting its session never breaks it. A request's drafter resumes a session's state only when the request
continues that conversation (names it, or its prompt holds the session's whole previous prompt); sharing only a prefix
(a common system prompt) reuses that prefix's KV, but the drafter starts afresh.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from drafters.base import TOKEN_BYTES, common_prefix_len
from scheduler.config import SessionConfig
from scheduler.kv_blocks import KVBlockManager
from scheduler.request import Request

HASH_BYTES = 44  # a 64-bit hash in a list: reference and a 36-byte int object
NAMED_KEY_PREFIX = "named:"  # sessions the client names
IMPLICIT_KEY_PREFIX = "implicit:"  # sessions found by their prefix
EXPLICIT, IMPLICIT = "explicit", "implicit"  # how a conversation finds its session: named, or by its prompt's prefix
SESSION_KINDS = (EXPLICIT, IMPLICIT)


@dataclass
class Session:
    key: str
    token_ids: list[int]  # [history length] the last turn's prompt and output
    block_ids: list[int]  # KV blocks held: positions [0, len(block_ids) * block_size) of token_ids
    block_hashes: list[int]  # [len(block_ids)] chained hashes of those blocks' tokens
    num_prompt_tokens: int  # prompt length of the last turn
    last_used: float  # seconds, monotonic clock

    @property
    def host_bytes(self) -> int:
        """Host memory of its lists (the KV blocks themselves live in the pool, counted there)."""
        return TOKEN_BYTES * (len(self.token_ids) + len(self.block_ids)) + HASH_BYTES * len(self.block_hashes)


@dataclass
class SessionStats:
    """Counts since the last `take_stats`."""

    hits: int = 0  # requests that found a cached session
    misses: int = 0  # requests that looked for one and found none
    reused_tokens: int = 0  # prompt tokens whose KV came from a session: prefill saved
    evictions: int = 0  # sessions dropped by the LRU, the TTL or the cap
    # later turns of conversations (requests that say they continue one), by kind (explicit: named; implicit:
    # matched by prefix): continued from their cached session, or arrived where none was cached
    conversation_hits: dict[str, int] = field(default_factory=dict)
    conversation_misses: dict[str, int] = field(default_factory=dict)

    def count_conversation(self, kind: str, continued: bool) -> None:
        counts = self.conversation_hits if continued else self.conversation_misses
        counts[kind] = counts.get(kind, 0) + 1


class SessionStore:
    def __init__(
        self, config: SessionConfig, blocks: KVBlockManager, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.clock = clock  # seconds
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._keys_by_hash: dict[int, set[str]] = {}  # chained block hash -> sessions holding that block
        self._turn_keys: dict[str, str] = {}  # request id -> key of the session its turn will update
        self._num_implicit = 0
        self.stats = SessionStats()
        self._evicted_keys: list[str] = []  # sessions evicted since the last take_evicted_keys
        self._host_bytes = 0  # the sessions' host_bytes, summed as each is kept or evicted (read every step)

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    def host_bytes(self) -> int:
        """Host memory of the cached sessions' histories and block lists (drafter states are the engine's)."""
        return self._host_bytes

    def take_stats(self) -> SessionStats:
        stats, self.stats = self.stats, SessionStats()
        return stats

    def take_evicted_keys(self) -> list[str]:
        """Keys of the sessions evicted since the last call: whatever is kept under them elsewhere can go."""
        keys, self._evicted_keys = self._evicted_keys, []
        return keys

    # --- a turn begins ------------------------------------------------------------------
    def attach(self, req: Request) -> str | None:
        """Find the request's session and start its KV after the cached prefix; returns the key of the session whose
        drafter state the request resumes (None: its drafter starts afresh).

        Call before the request is first scheduled.
        """
        named = NAMED_KEY_PREFIX + req.session_id if req.session_id is not None else None
        session = self.sessions.get(named) if named else None
        if session is None and self.config.mode == "implicit":
            session = self._longest_prefix_session(req.prompt_token_ids)
        if session is None:
            self.stats.misses += 1
            self._count_conversation(req, continued=False)
            self._turn_keys[req.request_id] = named or self._new_implicit_key()
            return None
        self.stats.hits += 1
        num_common = common_prefix_len(session.token_ids, req.prompt_token_ids)
        self._share_prefix(req, session, num_common)
        self._touch(session)
        continues = session.key == named or (named is None and num_common >= session.num_prompt_tokens)
        self._count_conversation(req, continued=continues)
        self._turn_keys[req.request_id] = named or (session.key if continues else self._new_implicit_key())
        return session.key if continues else None

    def _count_conversation(self, req: Request, continued: bool) -> None:
        """A later turn of a conversation is a hit where it continues its cached session, else a miss: it arrived
        on a replica that does not hold it (or its session was evicted). First turns count as neither."""
        if req.continues:
            self.stats.count_conversation(EXPLICIT if req.session_id is not None else IMPLICIT, continued)

    def _share_prefix(self, req: Request, session: Session, num_common: int) -> None:
        """The request reads the session's blocks of their common prefix; its last prompt token is always computed."""
        num_blocks = min(
            min(num_common, len(req.prompt_token_ids) - 1) // self.blocks.block_size, len(session.block_ids)
        )
        if num_blocks:
            self.blocks.share(req.request_id, session.block_ids[:num_blocks])
            req.num_computed_tokens = req.num_cached_tokens = num_blocks * self.blocks.block_size
            self.stats.reused_tokens += req.num_cached_tokens

    def _longest_prefix_session(self, prompt_ids: list[int]) -> Session | None:
        """The most recently used session holding the longest run of the prompt's full blocks."""
        size = self.blocks.block_size
        hashes = chained_block_hashes(prompt_ids[:len(prompt_ids) - 1], size)
        for num_blocks in range(len(hashes), 0, -1):
            keys = self._keys_by_hash.get(hashes[num_blocks - 1], ())
            for session in sorted((self.sessions[k] for k in keys), key=lambda s: -s.last_used):
                if session.token_ids[:num_blocks * size] == prompt_ids[:num_blocks * size]:  # not a hash collision
                    return session
        return None

    def _new_implicit_key(self) -> str:
        self._num_implicit += 1
        return f"{IMPLICIT_KEY_PREFIX}{self._num_implicit}"

    # --- a turn ends (scheduler/admission.py's finish, then the engine's release) ----------
    def keep(self, req: Request, block_ids: list[int]) -> None:
        """Make the finishing request's history its session's; hold its full blocks of computed KV."""
        key = self._turn_keys.get(req.request_id)
        if key is None:
            return
        num_blocks = min(req.num_computed_tokens // self.blocks.block_size, len(block_ids))
        kept = block_ids[:num_blocks]
        self.blocks.hold(kept)  # before the old turn's blocks go: the two share a prefix
        session = self.sessions.get(key)
        if session is None:
            session = self.sessions[key] = Session(key, [], [], [], 0, self.clock())
        else:
            self._host_bytes -= session.host_bytes
            self._drop_blocks(session)
        session.token_ids = list(req.all_token_ids)
        session.num_prompt_tokens = req.num_prompt_tokens
        session.block_ids = kept
        session.block_hashes = chained_block_hashes(
            session.token_ids[:num_blocks * self.blocks.block_size], self.blocks.block_size
        )
        for block_hash in session.block_hashes:
            self._keys_by_hash.setdefault(block_hash, set()).add(key)
        self._host_bytes += session.host_bytes
        self._touch(session)
        while len(self.sessions) > self.config.max_sessions:
            self.evict_least_recent()

    def end(self, request_id: str) -> str | None:
        """The request is gone; returns the key of the session its turn updated, None if it updated none."""
        key = self._turn_keys.pop(request_id, None)
        return key if key in self.sessions else None

    # --- bounds ---------------------------------------------------------------------------
    def reclaim(self, num_blocks: int) -> None:
        """Evict least recently used sessions until `num_blocks` more blocks are free, or no session holds one."""
        target = self.blocks.num_free_blocks + num_blocks
        while self.sessions and self.blocks.num_free_blocks < target and self.blocks.num_held_only_blocks:
            self.evict_least_recent()

    def expire(self) -> None:
        """Evict the sessions unused for longer than the TTL."""
        deadline = self.clock() - self.config.ttl_s
        while self.sessions and next(iter(self.sessions.values())).last_used < deadline:
            self.evict_least_recent()

    def evict_least_recent(self) -> None:
        _, session = self.sessions.popitem(last=False)
        self._host_bytes -= session.host_bytes
        self._drop_blocks(session)
        self.stats.evictions += 1
        self._evicted_keys.append(session.key)

    def _drop_blocks(self, session: Session) -> None:
        for block_hash in session.block_hashes:
            keys = self._keys_by_hash[block_hash]
            keys.discard(session.key)
            if not keys:
                del self._keys_by_hash[block_hash]
        self.blocks.release(session.block_ids)
        session.block_ids, session.block_hashes = [], []

    def _touch(self, session: Session) -> None:
        session.last_used = self.clock()
        self.sessions.move_to_end(session.key)


def chained_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """[full blocks of token_ids] hash of each block's tokens chained with every block before it."""
    hashes, previous = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, *token_ids[start:start + block_size]))
        hashes.append(previous)
    return hashes
