"""Where each sequence's queries and keys sit for one packed forward, and what each query may see.

Built once per step by the runner (engine/model/packed_runner.py) from the forward items, read by every layer's
attention (engine/model/paged_attention.py). A sequence's keys are its KV indices 0 .. L-1 (cached, then new). Its new
token i sees every cached key and, among the new ones, itself and its ancestors: all the tokens before it for a
causal chain, its tree path for a tree.

Where attention skips masked keys (the CPU row kernel, engine/model/csrc/row_attention.cpp) a tree is attended in
place: one sequence, its new tokens' keys where the block table puts them, each row masked to the cached keys and its
ancestors; a row's allowed keys are then the same keys in the same order as in its path drafted as a chain, so it gets
the same bits. Elsewhere a tree is attended as the chains of its root-to-leaf paths (`tree_paths`): each path's keys
are the cached ones followed by its own nodes' keys, in order, so a node's attention is computed exactly as if its
path had been drafted as a chain (masking the other branches' keys in place would move the path's terms along the
keys, and a float32 matmul's sum depends on where its terms sit). Each node is computed once, in the first path that
holds it; every path re-reads the context.

Sliding windows (Gemma 2/3, Mistral, Phi-3, per layer): a query at position p sees a key only if the key's position
is above p - window, as transformers' masks say (masking_utils.sliding_window_overlay). A layout records each mask
row's query position and each key's position (`MaskPositions`): cached key i sits at position i, a new key at its
token's position (for a chain or a tree path that is its KV index; a tree attended in place has its nodes at their
depths' positions, past their KV indices), so each row's window keeps the same keys as its path drafted as a chain,
however deep the tree. A windowed mask is the full mask narrowed so, made on the first layer that asks for that
window and reused by the step's others (`windowed_mask`). A row keeps its keys at the same KV indices, so it
computes the same bits in every forward, as without a window. Keys that fall out of every window stay in the pool:
attention skips them, nothing frees them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F

# Batch invariance: a token's logits must not depend on the forward it is computed in (decoding, verifying a
# chain or a tree of drafts, a prefill chunk, beside other requests). With bfloat16 activations (--weights
# bfloat16/int8/int4) a last-bit difference upstream flips roundings and moves logits by tenths, far beyond the
# near-ties greedy exactness allows, and a seeded request would sample differently on a second run that finds its
# prefix cached. The Linear kernels compute each row alone; attention is made so on the CPU
# (engine/model/paged_attention.py): plain batched matmuls, with the softmax's sum taken by a matmul too (a matmul adds
# along the keys in order, so masked keys anywhere, such as a tree's other branches, add exact zeros, where a
# vectorised sum's lanes would shift), over query rows padded to a multiple of 4 per KV head (rows in a trailing
# partial group of 4 take another kernel) and keys padded to a multiple of 64, at least 384, each product over the
# keys taken 64 keys at a time (a BLAS groups a longer sum by its own blocking, which differs between CPUs: MKL
# regroups above 384 keys on some). tests/engine/model/test_packed_runner.py checks it bit for bit.
KEY_MULTIPLE = 64
MIN_KEYS = 384
PADDING_POSITION = -1  # the query position of a padding row: no key falls out of its window


@dataclass
class MaskPositions:
    """The positions a sliding window compares, shaped to broadcast against the mask they belong to (kept on the
    CPU: only a layer with a window reads them, on its device)."""

    queries: torch.Tensor  # [..., rows, 1] each mask row's query position (padding rows: PADDING_POSITION)
    keys: torch.Tensor  # [..., 1, L] each key's position
    last: int  # the latest query position: a window longer than it hides no key
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> the narrowed mask, made once

    @staticmethod
    def of(queries: torch.Tensor, keys: torch.Tensor) -> MaskPositions:
        return MaskPositions(queries, keys, int(queries.max()))


def windowed_mask(mask: torch.Tensor, positions: MaskPositions | None, window: int | None) -> torch.Tensor:
    """MASK narrowed to WINDOW (a query at p sees keys at positions above p - window), made on first use and kept
    in POSITIONS for the step's other layers; MASK itself where no window applies or none hides a key."""
    if window is None or positions is None or positions.last < window:
        return mask
    narrowed = positions.windowed.get(window)
    if narrowed is None:
        visible = positions.keys > positions.queries - window
        narrowed = positions.windowed[window] = mask & visible.to(mask.device)
    return narrowed


@dataclass
class AttentionGroup:
    """Sequences attended with one padded SDPA call: R sequences, up to Q new tokens, up to L keys each."""

    query_index: torch.Tensor  # [R, Q] packed index of each padded query (padding repeats a real one)
    block_table: torch.Tensor  # [R, ceil(L / block_size)] pool blocks of each sequence (padding points at block 0)
    block_size: int
    max_len: int  # L
    mask: torch.Tensor  # [R, 1, heads_per_kv_head * Q, L] True where a query may look
    valid: torch.Tensor  # [n] flat indices into [R * Q] of the real queries, in packed order
    packed_index: torch.Tensor  # [n] packed index of those queries
    tail_keys: torch.Tensor | None = None  # [m] flat indices into the gathered [R * blocks * block_size] keys that
    tail_slots: torch.Tensor | None = None  # [m] take these pool slots' keys instead (a tree path's nodes)
    positions: MaskPositions | None = None  # the query and key positions sliding windows compare
    scratch: torch.Tensor | None = None  # buffers the layers gather keys and values into, made by the first layer
    # window (None: none) -> the CPU path's padded, inverted mask (paged_attention._blocked), likewise
    blocked: dict[int | None, torch.Tensor] = field(default_factory=dict)


@dataclass
class InPlaceSpan:
    """One sequence attended where its keys lie in the pool, nothing copied: by the CPU row kernel at its KEY_SLOTS
    wherever its blocks are, elsewhere on a view of the pool where they occupy consecutive slots (FIRST_SLOT on)."""

    query_start: int  # packed index of its first new token
    query_len: int  # Q
    first_slot: int | None  # pool slot of its KV index 0 (consecutive slots), or None (the row kernel's KEY_SLOTS)
    context_len: int  # L, padded (padded_key_len)
    mask: torch.Tensor  # [1, 1, heads_per_kv_head * Q, L] True where a query may look
    positions: MaskPositions | None = None  # the query and key positions sliding windows compare
    # window (None: none) -> the CPU path's padded, inverted mask (paged_attention._blocked), made once
    blocked: dict[int | None, torch.Tensor] = field(default_factory=dict)
    key_slots: torch.Tensor | None = None  # [L] int64 the pool slot of each key (padding: slot 0), for the row kernel


@dataclass
class GroupMember:
    """One sequence as the layout sees it: a causal chain, or a tree attended in place (ANCESTORS given); elsewhere
    a tree is laid out as the chains of its paths, `tree_paths`."""

    query_start: int  # packed index of its first new token
    query_len: int
    context_len: int  # keys: cached + new
    block_table: list[int]
    query_rows: list[int] | None = None  # packed indices of its queries when they are not query_start onwards
    tail_slots: list[int] | None = None  # pool slots of its last keys when they are not where the block table says
    ancestors: torch.Tensor | None = None  # a tree attended in place: [n, n] ancestor_matrix of its new tokens
    # positions of its last keys (its new tokens, or a tree path's nodes), its queries the last query_len of them;
    # None: every key's position is its KV index
    positions: list[int] | None = None


def tree_paths(member: GroupMember, parents: list[int], slots: list[int]) -> list[GroupMember]:
    """The tree MEMBER (new tokens with PARENTS, written to SLOTS) as causal chains, one per root-to-leaf path:
    keys = the cached context, then the path's nodes; queries = the path's nodes no earlier path computes."""
    has_child = {parent for parent in parents if parent >= 0}
    num_cached = member.context_len - member.query_len
    done, chains = set(), []
    for leaf in (row for row in range(len(parents)) if row not in has_child):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        new = [row for row in path if row not in done]  # a suffix of the path: earlier paths hold its ancestors
        done.update(new)
        chains.append(GroupMember(
            member.query_start, len(new), num_cached + len(path), member.block_table,
            query_rows=[member.query_start + row for row in new], tail_slots=[slots[row] for row in path],
            positions=[member.positions[row] for row in path] if member.positions is not None else None,
        ))
    return chains


@dataclass
class FlashMetadata:
    """flash-attn's varlen call over the chains of a batch (trees go through SDPA in the same step)."""

    query_index: torch.Tensor  # [n] packed indices of the chains' tokens, in order
    cu_seqlens_q: torch.Tensor  # [R + 1] int32 offsets of each chain's new tokens
    cu_seqlens_k: torch.Tensor  # [R + 1] int32 offsets of each chain's keys
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [R, max blocks] int32


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: entry (i, j) is True when token j is token i itself or one of its ancestors (parent -1 = none)."""
    n = len(parents)
    seen = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            seen[i] |= seen[parent]
    return seen


def query_mask(
    member: GroupMember, num_rows: int, num_keys: int, ancestors: torch.Tensor | None = None
) -> torch.Tensor:
    """[num_rows, num_keys] bool for one sequence, a chain or (given its ANCESTORS) a tree; rows past its queries
    copy its first (their output is dropped)."""
    num_cached = member.context_len - member.query_len
    if ancestors is None and num_rows == member.query_len:  # a chain: each row sees the keys up to its own
        return torch.arange(num_keys) <= torch.arange(num_cached, member.context_len)[:, None]
    mask = torch.zeros(num_rows, num_keys, dtype=torch.bool)
    mask[:, :num_cached] = True
    new = ancestors if ancestors is not None else torch.ones(member.query_len, member.query_len).tril().bool()
    mask[:member.query_len, num_cached:member.context_len] = new
    mask[member.query_len:, num_cached] = True  # padding rows see one key, so their softmax stays finite
    return mask


def member_positions(member: GroupMember, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(query positions [query_len], key positions [num_keys]) of one sequence: a key's position is its KV index
    but for the last keys that MEMBER gives positions (a tree's nodes sit at their depth)."""
    given = _last_positions(member)
    keys = torch.arange(num_keys)
    keys[member.context_len - len(given):member.context_len] = torch.tensor(given, dtype=torch.long)
    return torch.tensor(given[len(given) - member.query_len:], dtype=torch.long), keys


def _last_positions(member: GroupMember) -> list[int]:
    """The positions of MEMBER's last keys, its queries the last query_len of them."""
    if member.positions is not None:
        return list(member.positions)
    return list(range(member.context_len - member.query_len, member.context_len))


def _layout_positions(members: list[GroupMember], max_q: int, max_len: int, heads_per_kv_head: int) -> MaskPositions:
    """The positions of a [R, 1, heads_per_kv_head * Q, L] mask's rows and keys (padding rows: PADDING_POSITION),
    as `member_positions` gives them, written in one go."""
    queries = torch.full((len(members), max_q), PADDING_POSITION)
    keys = torch.arange(max_len).repeat(len(members), 1)
    query_at, key_at, query_positions, key_positions = [], [], [], []
    for r, member in enumerate(members):
        given = _last_positions(member)
        key_at += range(r * max_len + member.context_len - len(given), r * max_len + member.context_len)
        key_positions += given
        query_at += range(r * max_q, r * max_q + member.query_len)
        query_positions += given[len(given) - member.query_len:]
    keys.view(-1)[torch.tensor(key_at)] = torch.tensor(key_positions)
    queries.view(-1)[torch.tensor(query_at)] = torch.tensor(query_positions)
    return MaskPositions.of(_tile_mask(queries[:, None, :, None], heads_per_kv_head), keys[:, None, None])


def _chain_masks(members: list[GroupMember], max_q: int, max_len: int) -> torch.Tensor:
    """[R, Q, L] causal masks of chains, built in one go: query i of a chain sees keys up to its own position."""
    offsets = torch.arange(max_q)
    q_lens = torch.tensor([m.query_len for m in members])
    ctx_lens = torch.tensor([m.context_len for m in members])
    query_positions = ctx_lens[:, None] - q_lens[:, None] + offsets[None, :]  # [R, Q]
    return torch.arange(max_len)[None, None, :] <= query_positions[:, :, None]


def build_group(
    members: list[GroupMember], block_size: int, heads_per_kv_head: int, device: torch.device,
    with_positions: bool = True,
) -> AttentionGroup:
    """The padded attention call of R sequences: sequence r's queries are its last query_len of context_len keys,
    causal for a chain, each row to its ancestors for a tree in place. WITH_POSITIONS False: no sliding window can
    hide a key of this step (`needs_positions`), so none are recorded."""
    max_q = max(m.query_len for m in members)
    max_len = padded_key_len(max(m.context_len for m in members))
    offsets = torch.arange(max_q)
    q_lens = torch.tensor([m.query_len for m in members])
    real = offsets[None, :] < q_lens[:, None]  # [R, Q]
    rows = [m.query_rows or list(range(m.query_start, m.query_start + m.query_len)) for m in members]
    query_index = torch.tensor([r + [r[0]] * (max_q - len(r)) for r in rows])
    max_blocks = -(-max_len // block_size)
    tables = [m.block_table[:max_blocks] for m in members]
    table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])  # [R, max_blocks]
    masks = _chain_masks(members, max_q, max_len)
    for r, member in enumerate(members):
        if member.ancestors is not None:
            masks[r] = query_mask(member, max_q, max_len, member.ancestors)
    mask = _tile_mask(masks[:, None], heads_per_kv_head).to(device)
    group = AttentionGroup(
        query_index.to(device), table.to(device), block_size, max_len, mask,
        real.flatten().nonzero()[:, 0].to(device), query_index[real].to(device),
        positions=_layout_positions(members, max_q, max_len, heads_per_kv_head) if with_positions else None,
    )
    _add_tail_keys(group, members, max_blocks * block_size, device)
    return group


def _add_tail_keys(
    group: AttentionGroup, members: list[GroupMember], keys_per_member: int, device: torch.device
) -> None:
    """Where members' last keys come from other slots than their block tables say (tree paths)."""
    flat, slots = [], []
    for r, member in enumerate(members):
        if member.tail_slots:
            first = member.context_len - len(member.tail_slots)
            flat += [r * keys_per_member + first + i for i in range(len(member.tail_slots))]
            slots += member.tail_slots
    if flat:
        group.tail_keys, group.tail_slots = torch.tensor(flat, device=device), torch.tensor(slots, device=device)


def in_place_span(
    member: GroupMember, first_slot: int | None, heads_per_kv_head: int, device: torch.device,
    with_positions: bool = True, block_size: int | None = None,
) -> InPlaceSpan:
    """The span of a sequence whose keys lie in consecutive slots from FIRST_SLOT on (the padding keys after them,
    whatever they hold, are masked) or, given BLOCK_SIZE, at the slots of its block table (for the row kernel);
    WITH_POSITIONS as `build_group` takes it."""
    num_keys = padded_key_len(member.context_len)
    mask = query_mask(member, member.query_len, num_keys, member.ancestors)[None, None]
    mask = _tile_mask(mask, heads_per_kv_head).to(device)
    positions = _layout_positions([member], member.query_len, num_keys, heads_per_kv_head) if with_positions else None
    slots = None if block_size is None else key_slots(member.block_table, member.context_len, num_keys, block_size)
    return InPlaceSpan(member.query_start, member.query_len, first_slot, num_keys, mask, positions, key_slots=slots)


def key_slots(block_table: list[int], context_len: int, num_keys: int, block_size: int) -> torch.Tensor:
    """[NUM_KEYS] int64: the pool slot of each of a sequence's CONTEXT_LEN keys in BLOCK_TABLE's blocks, then for the
    padding keys (masked: never read) the slots of the table's next ones, then slot 0 past the table."""
    blocks = torch.tensor(block_table[:-(-min(num_keys, len(block_table) * block_size) // block_size)])
    slots = (blocks[:, None] * block_size + _block_offsets(block_size)).view(-1)
    return slots[:num_keys] if len(slots) >= num_keys else F.pad(slots, (0, num_keys - len(slots)))


@cache
def _block_offsets(block_size: int) -> torch.Tensor:
    return torch.arange(block_size)


def needs_positions(members: list[GroupMember], narrowest_window: int | None) -> bool:
    """Whether a sliding window of NARROWEST_WINDOW positions or more (None: no layer has one) can hide a key from a
    query of MEMBERS: only where a query's position reaches the window (`windowed_mask`; a query's position is below
    its sequence's context length). Elsewhere a layout records no positions, which costs a decoding step tens of
    microseconds."""
    return narrowest_window is not None and max((m.context_len for m in members), default=0) > narrowest_window


def padded_key_len(num_keys: int) -> int:
    return max(MIN_KEYS, -(-num_keys // KEY_MULTIPLE) * KEY_MULTIPLE)


def _tile_mask(mask: torch.Tensor, heads_per_kv_head: int) -> torch.Tensor:
    """[R, 1, Q, L] -> [R, 1, heads_per_kv_head * Q, L]: the mask of every query head folded into rows (the Q rows
    repeated, as `repeat` tiles them; an expanded copy costs a fraction of `repeat` at this size)."""
    rows, _, num_queries, num_keys = mask.shape
    return mask[:, :, None].expand(-1, -1, heads_per_kv_head, -1, -1).reshape(rows, 1, -1, num_keys)


def contiguous_first_slot(block_table: list[int], num_keys: int, block_size: int) -> int | None:
    """The pool slot of KV index 0 when the first NUM_KEYS keys lie in one run of slots, else None."""
    table = block_table[:-(-num_keys // block_size)]
    if any(b != a + 1 for a, b in zip(table, table[1:])):
        return None
    return table[0] * block_size


@dataclass
class PagedRows:
    """The rows of a packed batch the Triton kernel attends (engine/model/triton_attention.py), per row: its packed
    index, its sequence's block table, the sequence's cached entries (all visible, within the layer's window), which of
    the step's new entries it sees (a bit per new row: its tree ancestors and itself; a chain's rows up to itself),
    where those end, and its position (the window counts back from it)."""

    row_index: torch.Tensor  # [n] int32 packed row of each
    block_tables: torch.Tensor  # [n, width] int32 its sequence's blocks, padded
    num_cached: torch.Tensor  # [n] int32 the sequence's entries before the step's new ones
    key_end: torch.Tensor  # [n] int32 one past the last entry it sees
    ancestors: torch.Tensor  # [n] int64 bit j: it sees the step's new entry num_cached + j
    positions: torch.Tensor  # [n] int32 its position


MAX_PAGED_ROWS_QUERY_LEN = 64  # new rows a sequence may bring to the kernel: one bit each in a 64-bit mask


@dataclass
class RowTable:
    """PagedRows' columns as lists, before they become tensors (engine/model/cuda_graphs.py fills its own)."""

    row_index: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    num_cached: list[int] = field(default_factory=list)
    key_end: list[int] = field(default_factory=list)
    ancestors: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    def add(self, query_start: int, item, block_size: int) -> None:
        """The rows of forward ITEM (engine/model/forward.py), a tree of at most MAX_PAGED_ROWS_QUERY_LEN new tokens
        or a chain of any length, whose first row is packed row QUERY_START. A longer chain's rows go in groups of
        MAX_PAGED_ROWS_QUERY_LEN, each row counting the earlier groups' entries as cached: every row's key and value
        are in the pool before any row attends, and a chain's entries lie at their positions, as cached ones do."""
        table = item.block_table[:-(-item.context_len // block_size)]
        if item.is_chain:
            for row in range(item.num_tokens):
                group_start = row - row % MAX_PAGED_ROWS_QUERY_LEN
                self._add_row(query_start + row, table, item.num_cached + group_start,
                              (1 << (row - group_start + 1)) - 1, item.positions[row])
            return
        for row, mask in enumerate(ancestor_masks(item.parents, item.num_tokens)):
            self._add_row(query_start + row, table, item.num_cached, mask, item.positions[row])

    def _add_row(self, packed_row: int, table: list[int], num_cached: int, mask: int, position: int) -> None:
        self.row_index.append(packed_row)
        self.tables.append(table)
        self.num_cached.append(num_cached)
        self.key_end.append(num_cached + mask.bit_length())
        self.ancestors.append(mask - (1 << 64) if mask >= 1 << 63 else mask)  # as a signed 64-bit integer
        self.positions.append(position)

    def padded_tables(self, pad_block: int = 0) -> list[list[int]]:
        """The rows' block tables, each padded with PAD_BLOCK to the widest."""
        width = max(len(t) for t in self.tables)
        return [t + [pad_block] * (width - len(t)) for t in self.tables]

    def tensors(self, device: torch.device) -> PagedRows:
        padded = self.padded_tables()

        def int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return PagedRows(int32(self.row_index), int32(padded), int32(self.num_cached), int32(self.key_end),
                         torch.tensor(self.ancestors, dtype=torch.int64, device=device), int32(self.positions))


def ancestor_masks(parents: list[int] | None, num_tokens: int) -> list[int]:
    """Per new token, the bits of the new tokens it sees: its ancestors and itself (PARENTS None: a causal chain)."""
    masks: list[int] = []
    for i in range(num_tokens):
        parent = i - 1 if parents is None else parents[i]
        masks.append((masks[parent] if parent >= 0 else 0) | (1 << i))
    return masks


def paged_rows(entries: list[tuple[int, object]], block_size: int, device: torch.device) -> PagedRows:
    """The PagedRows of ENTRIES, (packed row of its first token, forward item) each."""
    rows = RowTable()
    for query_start, item in entries:
        rows.add(query_start, item, block_size)
    return rows.tensors(device)
