"""The session store on real block bookkeeping: finding sessions, sharing prefixes, bounds, isolation."""
import pytest

from engine.wire import SamplingParams
from scheduler.config import SessionConfig
from scheduler.kv_blocks import KVBlockManager
from scheduler.request import Request
from scheduler.sessions import SessionStore, chained_block_hashes

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0  # seconds

    def __call__(self) -> float:
        return self.now


def make_store(mode="implicit", num_blocks=64, ttl_s=600.0, max_sessions=8):
    clock = Clock()
    blocks = KVBlockManager(num_blocks, BLOCK)
    return SessionStore(SessionConfig(mode, ttl_s, max_sessions), blocks, clock), blocks, clock


def finish_turn(store, blocks, request_id, prompt, output, session_id=None):
    """Run one turn's bookkeeping as the engine does: attach, compute every position, finish; returns the request
    and the key of the session whose drafter state it resumed."""
    req = Request(request_id, list(prompt), SamplingParams(temperature=0.0), session_id)
    resumed = store.attach(req)
    req.all_token_ids += output
    req.num_computed_tokens = len(req.all_token_ids) - 1
    blocks.grow(request_id, req.num_computed_tokens)
    store.keep(req, blocks.block_tables[request_id])
    blocks.free(request_id)
    assert store.end(request_id) == store.sessions[next(reversed(store.sessions))].key  # the session it updated
    return req, resumed


def new_request(store, request_id, prompt, session_id=None):
    req = Request(request_id, list(prompt), SamplingParams(temperature=0.0), session_id)
    return req, store.attach(req)


TURN1 = list(range(100, 111))  # 11 prompt tokens
ANSWER1 = list(range(200, 210))  # 10 generated: 20 positions computed, 5 full blocks


def test_a_named_session_gives_its_next_turn_the_cached_prefix_and_its_drafter_state_key():
    store, blocks, _ = make_store(mode="explicit")
    first, resumed = finish_turn(store, blocks, "t1", TURN1, ANSWER1, session_id="chat-1")
    assert resumed is None and first.num_cached_tokens == 0
    turn2 = TURN1 + ANSWER1 + [300, 301, 302]
    req, resumed = new_request(store, "t2", turn2, session_id="chat-1")
    assert resumed == "named:chat-1"
    assert req.num_computed_tokens == req.num_cached_tokens == 20  # 5 full blocks of computed history
    assert blocks.block_tables["t2"] == store.sessions["named:chat-1"].block_ids
    assert store.take_stats().hits == 1 and store.stats.hits == 0


def test_explicit_mode_never_matches_a_request_that_names_no_session():
    store, blocks, _ = make_store(mode="explicit")
    finish_turn(store, blocks, "t1", TURN1, ANSWER1, session_id="chat-1")
    req, resumed = new_request(store, "t2", TURN1 + ANSWER1 + [300])
    assert resumed is None and req.num_cached_tokens == 0 and "t2" not in blocks.block_tables
    stats = store.take_stats()
    assert (stats.hits, stats.misses) == (0, 2)


def test_implicit_mode_finds_the_session_by_its_longest_cached_prefix():
    store, blocks, _ = make_store()
    finish_turn(store, blocks, "other", [7] * 30, [8] * 5)  # another conversation
    finish_turn(store, blocks, "t1", TURN1, ANSWER1)
    req, resumed = new_request(store, "t2", TURN1 + ANSWER1 + [300, 301])
    assert resumed == next(reversed(store.sessions)) and resumed.startswith("implicit:") and req.num_cached_tokens == 20


def test_the_last_prompt_token_is_always_computed_even_when_the_whole_prompt_is_cached():
    store, blocks, _ = make_store()
    finish_turn(store, blocks, "t1", TURN1, ANSWER1 + [999] * 10)  # 30 computed positions
    req, _ = new_request(store, "again", TURN1 + ANSWER1[:9])  # exactly 20 tokens, all cached
    assert req.num_cached_tokens == 16 and req.num_uncomputed_tokens == 4


def test_a_shared_system_prompt_reuses_kv_but_not_another_conversations_drafter_state():
    store, blocks, _ = make_store()
    system = list(range(50, 62))  # 3 full blocks
    finish_turn(store, blocks, "a1", system + [1, 2, 3, 4, 5], [6, 7, 8])
    req, resumed = new_request(store, "b1", system + [9, 9, 9, 9, 9])
    assert resumed is None, "b must not draw on a's conversation"
    assert req.num_cached_tokens == 12
    finish = Request("b1", req.all_token_ids, req.sampling)
    assert store._turn_keys["b1"] != store._turn_keys.get("a1", "named:none")
    assert finish is not None


def test_an_edited_earlier_turn_reuses_the_prefix_before_the_edit_and_keeps_the_conversation_in_explicit_mode():
    store, blocks, _ = make_store(mode="explicit")
    finish_turn(store, blocks, "t1", TURN1, ANSWER1, session_id="c")
    edited = TURN1[:6] + [999] + TURN1[7:] + [300]  # the user changed a word of turn 1
    req, resumed = new_request(store, "t2", edited, session_id="c")
    assert resumed == "named:c"  # same conversation: the drafter may copy from the old version
    assert req.num_cached_tokens == 4  # only the block before the edit


def test_a_finished_turn_replaces_its_session_history_and_releases_the_old_blocks():
    store, blocks, _ = make_store(mode="explicit")
    finish_turn(store, blocks, "t1", TURN1, ANSWER1, session_id="c")
    old_blocks = list(store.sessions["named:c"].block_ids)
    finish_turn(store, blocks, "t2", TURN1 + ANSWER1 + [300, 301], [400, 401, 402], session_id="c")
    session = store.sessions["named:c"]
    assert session.token_ids == TURN1 + ANSWER1 + [300, 301, 400, 401, 402]
    assert session.block_ids[:5] == old_blocks and len(session.block_ids) == 6  # 24 of 24 computed positions
    assert blocks.num_free_blocks == blocks.num_blocks - 6 and blocks.usage == 0


def test_the_least_recently_used_session_goes_when_the_cap_is_passed():
    store, blocks, clock = make_store(max_sessions=2)
    for name in ("a", "b", "c"):
        clock.now += 1
        finish_turn(store, blocks, name, [ord(name)] * 9, [1], session_id=name)
    assert list(store.sessions) == ["named:b", "named:c"]
    assert store.take_stats().evictions == 1
    # the evicted keys are for the engine's drafter states
    assert store.take_evicted_keys() == ["named:a"] and store.take_evicted_keys() == []
    assert blocks.num_free_blocks == blocks.num_blocks - 4  # a's two blocks came back


def test_sessions_expire_after_their_ttl():
    store, blocks, clock = make_store(ttl_s=10)
    finish_turn(store, blocks, "old", [5] * 9, [1], session_id="old")
    clock.now = 6
    finish_turn(store, blocks, "new", [6] * 9, [1], session_id="new")
    clock.now = 12
    store.expire()
    assert list(store.sessions) == ["named:new"]
    clock.now = 17
    store.expire()
    assert not store.sessions and blocks.num_free_blocks == blocks.num_blocks


def test_reclaim_frees_blocks_least_recently_used_first_and_never_a_block_a_request_reads():
    store, blocks, clock = make_store(num_blocks=8)
    clock.now = 1
    finish_turn(store, blocks, "a", [1] * 8, [2], session_id="a")  # holds 2 blocks
    clock.now = 2
    finish_turn(store, blocks, "b", [3] * 8, [4], session_id="b")  # holds 2 blocks
    reader, _ = new_request(store, "b2", [3] * 8 + [4, 5], session_id="b")  # reads b's 2 blocks
    assert blocks.num_free_blocks == 4
    store.reclaim(2)
    assert list(store.sessions) == ["named:b"] and blocks.num_free_blocks == 6
    store.reclaim(2)  # b's blocks are read by b2: evicting b would free nothing, so b stays
    assert list(store.sessions) == ["named:b"] and blocks.num_free_blocks == 6
    store.sessions.clear()
    blocks.release([0, 1])  # as if b had gone anyway: b2 still holds what it reads
    assert blocks.num_free_blocks == 6
    blocks.free("b2")
    assert blocks.num_free_blocks == 8


def test_a_turn_that_computed_only_part_of_its_prompt_keeps_only_full_blocks_of_computed_kv():
    store, blocks, _ = make_store(mode="explicit")
    req, _ = new_request(store, "cut", list(range(40)), session_id="c")
    blocks.grow("cut", 10)
    req.num_computed_tokens = 10  # aborted after a first prefill chunk of 10 positions
    store.keep(req, blocks.block_tables["cut"])
    blocks.free("cut")
    assert len(store.sessions["named:c"].block_ids) == 2


def test_a_hash_collision_is_not_taken_for_a_match():
    store, blocks, _ = make_store()
    finish_turn(store, blocks, "t1", TURN1, ANSWER1)
    session = next(iter(store.sessions.values()))
    forged = [7, 7, 7, 7, 8, 8, 8, 8, 9]
    for block_hash in chained_block_hashes(forged[:-1], BLOCK):  # pretend the forged prompt's blocks collide
        store._keys_by_hash.setdefault(block_hash, set()).add(session.key)
    req, resumed = new_request(store, "forged", forged)
    assert resumed is None and req.num_cached_tokens == 0


@pytest.mark.parametrize("mode", ["explicit", "implicit"])
def test_named_and_implicit_sessions_never_share_a_key(mode):
    store, blocks, _ = make_store(mode=mode)
    finish_turn(store, blocks, "named", [1] * 9, [2], session_id="implicit:1")
    finish_turn(store, blocks, "anon", [5] * 9, [6])
    assert len(store.sessions) == 2 and "named:implicit:1" in store.sessions


def later_turn(store, request_id, prompt, session_id=None):
    req = Request(request_id, list(prompt), SamplingParams(temperature=0.0), session_id, continues=True)
    return req, store.attach(req)


def test_later_turns_count_as_hits_where_their_conversation_is_cached_and_misses_where_not_by_kind():
    store, blocks, _ = make_store()
    finish_turn(store, blocks, "named-1", TURN1, ANSWER1, session_id="chat-1")
    finish_turn(store, blocks, "anon-1", [7] * 12, [8] * 6)
    store.take_stats()  # first turns count as neither
    later_turn(store, "named-2", TURN1 + ANSWER1 + [300], session_id="chat-1")  # its session: hit
    later_turn(store, "lost-2", [1, 2, 3, 4, 5], session_id="chat-elsewhere")  # held by another replica: miss
    later_turn(store, "anon-2", [7] * 12 + [8] * 6 + [9])  # continues the anonymous conversation: hit
    later_turn(store, "stranger-2", [7] * 8 + [5] * 10)  # shares a prefix, continues nothing cached: miss
    new_request(store, "fresh", [6] * 9)  # a first turn that finds nothing: neither
    stats = store.take_stats()
    assert stats.conversation_hits == {"explicit": 1, "implicit": 1}
    assert stats.conversation_misses == {"explicit": 1, "implicit": 1}
    assert (stats.hits, stats.misses) == (3, 2)  # the cache's own lookups count every request


def test_the_host_bytes_total_follows_sessions_kept_replaced_and_evicted():
    store, blocks, clock = make_store(ttl_s=10, max_sessions=2)

    def held():
        return sum(session.host_bytes for session in store.sessions.values())

    finish_turn(store, blocks, "a1", TURN1, ANSWER1, session_id="a")
    assert store.host_bytes() == held() > 0
    finish_turn(store, blocks, "a2", TURN1 + ANSWER1 + [300], [400, 401], session_id="a")  # replaces a's history
    clock.now = 5
    finish_turn(store, blocks, "b1", [7] * 9, [1], session_id="b")
    assert store.host_bytes() == held()
    clock.now = 6
    finish_turn(store, blocks, "c1", [8] * 9, [1], session_id="c")  # past the cap: a goes
    assert list(store.sessions) == ["named:b", "named:c"] and store.host_bytes() == held()
    clock.now = 15.5
    store.expire()  # b's TTL ran out
    assert list(store.sessions) == ["named:c"] and store.host_bytes() == held()
    store.reclaim(blocks.num_blocks)
    assert not store.sessions and store.host_bytes() == 0
