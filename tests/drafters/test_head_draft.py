"""What an EAGLE-3 head drafter keeps of a request (drafters/head_draft.py): the target's fused states each position
reads, the positions whose head KV holds real tokens, and what a session's next turn keeps of them."""
from types import SimpleNamespace

import torch

from drafters.base import CaptureSpec
from drafters.head_draft import HeadDrafter, HeadKV


def states(start: int, end: int) -> torch.Tensor:
    """[end - start, 2] a state per position whose entries are the position."""
    return torch.arange(start, end, dtype=torch.float32)[:, None].repeat(1, 2)


def test_each_position_reads_the_state_before_it_and_zeros_where_none_is_kept():
    kv = HeadKV()
    kv.add_states(3, states(3, 5))
    kv.add_states(5, states(5, 6))  # contiguous: appended
    read = kv.read_by(2, 8, width=2)[:, 0].tolist()
    assert read == [0.0, 0.0, 3.0, 4.0, 5.0, 0.0]  # positions 2..7 read the states at 1..6: 3, 4 and 5 are kept


def test_unread_states_stay_in_the_chunks_they_came_in_until_read():
    """A head the planner keeps off reads nothing for many steps: each step's states are kept as they came, not
    joined to the whole unread history every step (which grew quadratically), and read back in order."""
    kv = HeadKV()
    for position in range(100):
        kv.add_states(position, states(position, position + 1))
    assert len(kv.chunks) == 100 and kv.num_states == 100 and kv.num_bytes == 100 * 2 * 4
    assert kv.read_by(1, 101, width=2)[:, 0].tolist() == [float(p) for p in range(100)]
    kv.keep_from(99)
    assert len(kv.chunks) == 1 and kv.read_by(100, 101, 2)[0, 0] == 99.0


def test_states_read_are_dropped_and_a_gap_starts_afresh():
    kv = HeadKV()
    kv.add_states(0, states(0, 4))
    kv.keep_from(3)
    assert kv.states_start == 3 and kv.num_states == 1 and kv.read_by(4, 5, 2)[0, 0] == 3.0
    kv.keep_from(4)
    assert kv.num_states == 0 and kv.num_bytes == 0
    kv.add_states(9, states(9, 10))  # not after the kept ones (a preempted request computed again, say)
    assert kv.states_start == 9 and kv.read_by(10, 11, 2)[0, 0] == 9.0


class Forward:
    name = "head"
    shares_target_kv = False
    is_head = True
    hidden_size = 2
    state_size = 6
    captures = CaptureSpec(hidden_layers=(1, 1, 2))


def request(request_id: str, token_ids: list[int], num_computed: int):
    return SimpleNamespace(request_id=request_id, all_token_ids=token_ids, num_computed_tokens=num_computed,
                           sampling=SimpleNamespace(seed=None, greedy=True), draft=None)


def test_a_next_turn_keeps_what_the_head_read_of_the_shared_prefix_the_cache_kept():
    drafter = HeadDrafter(Forward(), max_tokens=3)
    assert drafter.captures.hidden_layers == (1, 1, 2)
    first = request("a", [5, 6, 7, 8, 9], 4)
    drafter.begin(first)
    drafter._kv["a"].num_valid = 5
    state = drafter.finish(first)
    assert state.token_ids == [5, 6, 7, 8, 9]
    drafter.begin(request("b", [5, 6, 7, 8, 9, 10, 11], 5), state)  # the history, then the new turn
    assert drafter._kv["b"].num_valid == 5
    drafter.finish(request("b", [5, 6, 7, 8, 9, 10, 11], 5))
    edited = request("c", [5, 6, 1, 2], 2)  # an edited turn parts from the history at position 2
    drafter.begin(edited, state)
    assert drafter._kv["c"].num_valid == 2
    drafter.begin(request("d", [5, 6, 7, 8, 9, 10], 3), HeadKV(num_valid=5, token_ids=[5, 6, 7, 8, 9]))
    assert drafter._kv["d"].num_valid == 3  # the cache kept three positions
