"""The Drafter contract shared by every drafter, and what a drafter is given and gives back."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence, TypeVar

from drafters.tree import chain_parents

if TYPE_CHECKING:
    import torch

    from drafters.model_ngrams import ModelNgrams

TOKEN_BYTES = 36  # host memory of an int in a Python list: an 8-byte reference and a 28-byte int object


class DraftableRequest(Protocol):
    """What a drafter may read of a request: its id, every token so far (prompt + output), how many of them the
    target has computed, its sampling parameters and the draft it is verifying."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    sampling: object  # engine/wire.py's SamplingParams
    draft: Draft | None


@dataclass(frozen=True)
class Draft:
    """A tree of drafted tokens (drafters/tree.py), parents first; a chain is the special case."""

    token_ids: list[int]  # [n] drafted tokens; empty = nothing worth verifying
    source: str  # the drafter that proposed it
    parents: list[int] = None  # [n] each token's parent index, -1 = the request's last token; None given = a chain
    # [n] the drafter's own estimate of each token's acceptance given its parent's
    acceptance: list[float] | None = None
    # look-ahead chains the drafter asks the target to extend beside the draft (SPECTRA's candidate pool): each hangs
    # off the request's last token, is not verified, and its last row's logits come back in Computed.lookahead_logits
    lookahead: tuple[tuple[int, ...], ...] = ()
    lookahead_yield: float = 0.0  # the drafter's measure of the tokens a look-ahead row earns later, per row
    # the forwards of the drafter's model that drafted it, where more than its depth (a tree whose deepest nodes were
    # not kept); 0: its depth
    forwards: int = 0

    def __post_init__(self) -> None:
        """A chain's parents are built valid; given parents are checked (a large batch builds a draft per request a
        step, most of them empty)."""
        if self.parents is None:
            object.__setattr__(self, "parents", chain_parents(len(self.token_ids)))
        elif len(self.parents) != len(self.token_ids) or any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError("a draft lists each token after its parent, one parent index per token")

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class CaptureSpec:
    """What a drafter needs from the target's forward beyond logits."""

    # the residual stream after each of these many decoder layers (transformers' hidden_states indices), concatenated
    hidden_layers: tuple[int, ...] = ()
    attention_heads: tuple[tuple[int, int], ...] = ()  # (layer, head) pairs whose attention rows it reads
    # whether a prompt prefix served from the KV cache may go unseen: the drafter then lacks its captures there (a
    # head reads zeros for them, which can cost acceptance, never exactness); otherwise the prefix is computed again
    # (PLD+ ranks every prompt position by them)
    skips_cached_prefix: bool = False

    @property
    def wants_any(self) -> bool:
        return bool(self.hidden_layers) or bool(self.attention_heads)

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position must be computed for the drafter, a cached prefix included."""
        return self.wants_any and not self.skips_cached_prefix


@dataclass
class Computed:
    """Tokens of one request whose KV the target just committed, with the captures its drafter asked for."""

    start: int  # position of token_ids[0]
    token_ids: list[int]  # [n] in position order: prefill chunks, or the last token and the accepted draft path
    hidden_states: torch.Tensor | None = None  # [n, hidden_size * len(hidden_layers)] in their order
    # [num capture heads, start + n] the last token's attention over every position
    attention: torch.Tensor | None = None
    # [chains, vocab] the logits after the last row of each look-ahead chain the step carried: the first chains of
    # the request's draft's `lookahead`, as many as the scheduler kept; None when it kept none
    lookahead_logits: torch.Tensor | None = None


class PldPlusCalibrationLike(Protocol):
    """What PLD+ reads of the served model's calibration (engine/artifacts.py's PldPlusCalibration)."""

    ranking: str  # "hidden" or "attention"
    layer: int  # hidden-state index
    heads: list[list[int]]  # [[layer, head], ...] as many as the calibration chose
    ranked_heads: list[list[int]]  # every head, best first


class ModelForward(Protocol):
    """A model the engine lends a drafter (engine/model/draft_model.py's DraftForward): packed forwards of chains
    addressed by request, with KV at the scheduler's block tables."""

    name: str
    shares_target_kv: bool  # an early exit of the target: every position the target computed is computed for it
    is_head: bool  # an EAGLE-3 head (engine/model/draft_model.py's HeadForward): it reads the target's states

    def __call__(
        self, chains: list[tuple[str, list[int], int]], num_logits: list[int] | None = None
    ) -> list[torch.Tensor]:
        """(request id, token ids, position of the first) per request -> per chain [num_logits, vocab] logits."""

    def reserve(self, reqs: list, beside: list, unread: dict[str, int]) -> dict[str, int]:
        """Request id -> how many tokens it may draft this step (the scheduler decides and reserves blocks); UNREAD:
        per request id, the tokens the model has not read of it, which its next round's first forward reads."""

    def probs(self, logits: torch.Tensor, params: object) -> torch.Tensor:
        """[vocab] logits -> the distribution a request with sampling PARAMS samples from."""


class AcceptanceTable(Protocol):
    """SV's companion table (engine/artifacts.py's SvTable): a drafted token's acceptance from its (S, A) cell."""

    def estimate(self, s: float, a: float) -> float: ...

    def observe(self, s: float, a: float, accepted: float) -> None: ...


@dataclass
class DrafterContext:
    """What a drafter's builder may use: the served model's identity and shape, its own forward, a cache folder."""

    model_fingerprint: str  # names the served weights, for tables derived from them
    vocab_size: int
    num_layers: int
    cache_dir: Path  # model-derived tables live under it
    # [B] tokens -> [B, vocab]: each after BOS
    next_token_logits: Callable[[list[int]], torch.Tensor] = field(repr=False)
    pld_plus_calibration: PldPlusCalibrationLike | None = None  # `specserve calibrate pld-plus`'s, if made
    draft_forward: ModelForward | None = None  # when the engine owns a draft model
    companion_forward: ModelForward | None = None  # the same over the companion model, when the engine owns one
    sv_tables: dict[bool, AcceptanceTable] = field(default_factory=dict)  # greedy? -> `specserve calibrate sv`'s table
    spectra_corpus: list[list[int]] | None = None  # `specserve calibrate corpus`'s documents, if made
    model_ngrams: ModelNgrams | None = None  # and its table of the model's own next tokens, if made


Value = TypeVar("Value")


def follow_longest_contexts(
    table: Mapping[tuple[int, ...], Value], token_ids: Sequence[int], longest: int, max_tokens: int,
    token_of: Callable[[Value], int] | None = None,
) -> list[tuple[tuple[int, ...], Value]]:
    """Up to MAX_TOKENS steps of a guess from a table of contexts: each the entry of the longest context (of the last
    LONGEST tokens of TOKEN_IDS and the guess so far) that TABLE holds, as (that context, its value); it stops where
    TABLE holds none. TOKEN_OF: the guessed token of a value (None: the value is the token)."""
    context = tuple(token_ids[-longest:])
    steps: list[tuple[tuple[int, ...], Value]] = []
    while len(steps) < max_tokens:
        for length in range(len(context), 0, -1):
            key = context[-length:]
            value = table.get(key)
            if value is not None:
                break
        else:
            break
        steps.append((key, value))
        context = (context + (value if token_of is None else token_of(value),))[-longest:]
    return steps


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Drafter(Protocol):
    """Per request: `begin`, then `observe`, `extend` and `propose` each step, `preempt` when it is sent back
    to the queue, and `finish`.

    A session cache carries a drafter's state from one turn of a conversation to the
    next: what `finish` returns for a turn is what `begin` gets for the conversation's
    next turn. A state is the drafter's own, opaque to everyone else; the next turn's
    prompt may extend the history it was built on or part from it (an edited turn),
    and `begin` must be right either way. A drafter keeps no reference to a state
    after `finish` returns it. Drafters never touch the KV cache or the scheduler.
    """

    name: str
    captures: CaptureSpec  # what it needs from the target's forward; CaptureSpec() = logits only

    def begin(self, req: DraftableRequest, state: object | None = None) -> None:
        """Index a new request: its prompt, on top of the state its session's last turn left (None: afresh)."""

    def observe(self, req: DraftableRequest, computed: Computed) -> None:
        """Every token the target computed for the request (prefill chunks too), with the captures asked for."""

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        """Take the tokens just appended to `req.all_token_ids` into the drafter's state."""

    def propose(self, reqs: Sequence[DraftableRequest]) -> list[Draft]:
        """One draft per request, in order."""

    def propose_resting(self, reqs: Sequence[DraftableRequest]) -> list[Draft]:
        """One draft per request resting from `propose` (the planner kept declining its drafts; scheduler/
        drafting_gate.py), in order: only guesses that cost next to nothing to find, or none (an empty draft)."""

    def preempt(self, req: DraftableRequest) -> None:
        """The request's KV was freed; it will be computed again from its tokens (and observed again)."""

    def finish(self, req: DraftableRequest) -> object | None:
        """Forget a request that finished or was aborted; returns its state for the session's next turn."""

    def distributions(self, req: DraftableRequest) -> torch.Tensor | None:
        """[len(req.draft), vocab] the distributions the request's draft tokens were sampled from (a draft model's
        q); None for point masses (copied or looked-up tokens, or greedy drafts)."""

    def state_bytes(self) -> int:
        """Memory its live requests' states hold beyond token ids (a returned state counts its own, `num_bytes`)."""


class DrafterBase:
    """Defaults for the parts of the contract most drafters do not need."""

    captures = CaptureSpec()

    def observe(self, req: DraftableRequest, computed: Computed) -> None:
        pass

    def propose_resting(self, reqs: Sequence[DraftableRequest]) -> list[Draft]:
        return [Draft([], self.name) for _ in reqs]

    def preempt(self, req: DraftableRequest) -> None:
        pass

    def distributions(self, req: DraftableRequest) -> torch.Tensor | None:
        return None

    def state_bytes(self) -> int:
        return 0
