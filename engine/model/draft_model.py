"""The draft model the engine owns beside the target (`--draft-model`), and the forward it lends its drafter.

Two kinds:
- `early-exit:N`: the target's own first N decoder layers, its final norm and its LM head,
  the very same modules (no extra weight memory). Its layers compute exactly the target's
  KV for those layers, so it reads and writes the target's own pool: every position the
  target has computed is already computed for it.
- a separate causal LM (what `--model` takes): its own weights and its own paged KV pool,
  as many slots as the target's, addressed through the same block tables, so admission,
  preemption, rollback and session prefix sharing cover it with the target. It must share
  the target's vocabulary.
- an EAGLE-3 head (a folder in that public layout, engine/model/eagle3.py): one layer that
  reads the target's own hidden states, with a one-layer pool of its own like a separate
  model's, drafting over a reduced vocabulary that `HeadForward` maps to the target's. A
  second head can be a draft head's companion (SV), scoring each token it drafts.

A draft model only ever proposes: whatever its KV holds can cost acceptance, never
exactness (the target verifies every drafted token).
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from drafters.base import CaptureSpec
from drafters.tree import TreeRows
from engine.config import ModelConfig
from engine.model.eagle3 import Eagle3Head, aux_layers, is_eagle3_head, load_eagle3_head
from engine.model.forward import ForwardBatch, chain_item
from engine.model.head_layout import HeadLayout
from engine.model.model_loader import LoadedModel, load_model
from engine.model.packed_runner import PackedModelRunner
from engine.model.paged_attention import PagedKVPool, kv_shape, skips_masked_keys
from engine.model.weights import apply_head_weights
from engine.sampler import target_probs
from scheduler.kv_blocks import KVBlockManager

EARLY_EXIT = "early-exit:"
SHIPPED_HEADS = Path(__file__).parent / "heads"  # a folder per model name: the EAGLE-3 head trained for it
MODEL_DRAFTERS = ("draft", "copyspec+draft")  # the drafters that draft with a draft model


@dataclass
class DraftModel:
    """A loaded draft model: the module, and whether it is an early exit sharing the target's KV."""

    name: str
    model: torch.nn.Module
    shares_target_kv: bool

    @property
    def kv_bytes_per_position(self) -> int:
        """Pool memory it needs per position beyond the target's (none for an early exit)."""
        if self.shares_target_kv:
            return 0
        return PagedKVPool.bytes_per_slot(*kv_shape(self.model.config), next(self.model.parameters()).dtype)


def shipped_head(model_name: str, drafter: str) -> str | None:
    """The head shipped for the model named MODEL_NAME (the embedded default has one), where DRAFTER drafts with a
    model and no --draft-model names one: `--drafter draft` then works without training anything."""
    path = SHIPPED_HEADS / model_name
    return str(path) if drafter in MODEL_DRAFTERS and is_eagle3_head(path) else None


def load_draft_model(spec: str, target: LoadedModel, config: ModelConfig, role: str = "draft") -> DraftModel:
    """`early-exit:N` or a model source, for ROLE (draft or companion); refuses a vocabulary not the target's."""
    if spec.startswith(EARLY_EXIT):
        return DraftModel(
            spec, early_exit_model(target.model, _exit_layers(spec, target.model, role)), shares_target_kv=True
        )
    if is_eagle3_head(spec):
        return _load_head(spec, target, role)
    loaded = load_model(replace(config, model=spec, max_model_len=None))
    draft_vocab, target_vocab = loaded.model.config.vocab_size, target.model.config.vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(
            f"the {role} model {spec!r} has a vocabulary of {draft_vocab} tokens and the target one of {target_vocab}: "
            f"a {role} model must share the target's tokenizer"
        )
    if loaded.device != target.device:
        raise ValueError(f"the {role} model loaded on {loaded.device}, the target on {target.device}")
    return DraftModel(loaded.source.name, loaded.model, shares_target_kv=False)


def _load_head(path: str, target: LoadedModel, role: str) -> DraftModel:
    """An EAGLE-3 head for TARGET, in float32 on a CPU (the target's dtype on a GPU), embedding with the target's
    embedding; refused where its vocabulary, hidden size or layers do not fit the target. As ROLE companion it scores
    a draft head's tokens (drafters/head_draft.py)."""
    config = target.model.config
    dtype = torch.float32 if target.device.type == "cpu" else next(target.model.parameters()).dtype
    head = load_eagle3_head(path, target.model.get_input_embeddings(), dtype, target.device)
    if target.device.type == "cpu":
        apply_head_weights(head, target.weights)
        head.make_lean()
    target_hidden = getattr(head.config, "target_hidden_size", None) or head.config.hidden_size
    if head.config.vocab_size != config.vocab_size or int(head.target_ids.max()) >= config.vocab_size:
        raise ValueError(f"the {role} head {path!r} is for a vocabulary of {head.config.vocab_size} tokens and the "
                         f"target has {config.vocab_size}: a head must be trained for the target's tokenizer")
    if target_hidden != config.hidden_size or head.config.hidden_size != config.hidden_size:
        raise ValueError(f"the {role} head {path!r} reads hidden states of size {target_hidden} and embeds at "
                         f"{head.config.hidden_size}; the target's are {config.hidden_size}")
    aux_layers(head.config, config.num_hidden_layers)  # refuses layers the target does not have
    return DraftModel(path, head, shares_target_kv=False)


def _exit_layers(spec: str, target: torch.nn.Module, role: str) -> int:
    num_layers = target.config.num_hidden_layers
    value = spec[len(EARLY_EXIT):]
    if not value.isdigit() or not 1 <= int(value) < num_layers:
        raise ValueError(f"--{role}-model {spec!r}: an early exit takes a layer count in [1, {num_layers - 1}]")
    return int(value)


def early_exit_model(target: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """The target's first NUM_LAYERS decoder layers with its final norm and LM head: new module objects around the
    target's own submodules, so nothing is copied. Layer i keeps its index, so it writes KV layer i of the pool."""
    inner = copy.copy(target.model)
    inner._modules = dict(target.model._modules)
    inner.layers = torch.nn.ModuleList(list(target.model.layers)[:num_layers])
    inner.config = copy.deepcopy(target.model.config)
    inner.config.num_hidden_layers = num_layers
    outer = copy.copy(target)
    outer._modules = dict(target._modules)
    outer.model = inner
    outer.config = inner.config
    return outer


def draft_pool(draft: DraftModel, target_pool: PagedKVPool, device: torch.device) -> PagedKVPool:
    """The target's own pool for an early exit; else a pool of as many slots for the draft model's KV."""
    if draft.shares_target_kv:
        return target_pool
    layers, kv_heads, head_dim = kv_shape(draft.model.config)
    dtype = next(draft.model.parameters()).dtype
    return PagedKVPool(layers, target_pool.keys.shape[1], kv_heads, head_dim, dtype, device)


# (requests, the rest of the batch, per request id the tokens the model has not read of it) -> request id -> tokens
Reserve = Callable[[list, list, dict], dict[str, int]]


def reserve_nothing(reqs: list, beside: list, unread: dict) -> dict[str, int]:
    """The reserve of a model that never drafts (a companion only scores drafted tokens)."""
    return {}


class DraftForward:
    """What the draft drafter is lent: packed forwards of chains over the draft model, addressed by request, with
    KV at the slots of the scheduler's block tables, and `reserve`: how many tokens each of the requests that are
    about to draft with the model may draft this step (the scheduler decides it and reserves their blocks). It is
    asked for the requests the model drafts for, beside the rest of the batch with the drafts they have:
    copy-covered requests of `copyspec+draft` hold no blocks for the model and gain nothing from it, but the
    draft's forwards delay them too."""

    def __init__(
        self, draft: DraftModel, runner: PackedModelRunner, blocks: KVBlockManager,
        latency_profile: dict[int, float], reserve: Reserve = reserve_nothing,
    ) -> None:
        self.name = draft.name
        self.shares_target_kv = draft.shares_target_kv
        self.model = draft.model
        self.runner = runner
        self.blocks = blocks
        self.latency_profile = latency_profile  # seconds of a forward by tokens, profiled at start-up
        self.reserve = reserve
        self.forwards: list[int] = []  # tokens of each forward run since `take_forwards` last took them

    def take_forwards(self) -> list[int]:
        """The tokens each forward carried since the last call: what the scheduler prices the measured drafting by."""
        forwards, self.forwards = self.forwards, []
        return forwards

    def _count(self, chains: list[tuple[str, list[int], int]]) -> None:
        self.forwards.append(sum(len(token_ids) for _, token_ids, _ in chains))

    def __call__(
        self, chains: list[tuple[str, list[int], int]], num_logits: list[int] | None = None
    ) -> list[torch.Tensor]:
        """(request id, token ids, position of the first) per request -> per chain [num_logits, vocab] float32 logits
        at its last NUM_LOGITS tokens (one each by default). A chain's KV is written at its positions' slots; it
        attends to every position before it."""
        self._count(chains)
        items = [
            chain_item(token_ids, start, self.blocks.block_tables[request_id], self.blocks.block_size, rows)
            for (request_id, token_ids, start), rows in zip(chains, num_logits or [1] * len(chains))
        ]
        return self.runner.execute(ForwardBatch(items)).logits

    @property
    def is_head(self) -> bool:
        return False

    @staticmethod
    def probs(logits: torch.Tensor, params) -> torch.Tensor:
        """[vocab] logits -> the model's distribution as a request samples: the processing plain sampling applies to
        the target's logits (temperature, top-k, top-p); a plain softmax for a greedy request."""
        return torch.softmax(logits.float(), dim=-1) if params.greedy else target_probs(logits[None], params)[0]


class HeadForward(DraftForward):
    """What a head drafter is lent (drafters/head_draft.py): the head's packed forwards, each token reading the fused
    state a drafter gives it, returning draft-vocabulary logits and each chain's last output, which the next drafted
    position reads; `target_logits` widens logits to the target's vocabulary (-inf outside the draft vocabulary, so a
    draft distribution is exactly 0 there) where a distribution is asked."""

    def __init__(
        self, draft: DraftModel, runner: PackedModelRunner, blocks: KVBlockManager,
        latency_profile: dict[int, float], target_config, reserve: Reserve = reserve_nothing,
        continuing: Callable[[list[float]], list[bool]] = lambda probabilities: [True] * len(probabilities),
    ) -> None:
        super().__init__(draft, runner, blocks, latency_profile, reserve)
        # which greedy chains, by their paths' probabilities, draft one more token this round (the scheduler decides)
        self.continuing = continuing
        head: Eagle3Head = draft.model
        self.target_layers = aux_layers(head.config, target_config.num_hidden_layers)
        self.hidden_size = head.config.hidden_size
        self.state_size = 3 * target_config.hidden_size  # the target's states a head entry reads, concatenated
        self.vocab_size = target_config.vocab_size
        self.target_ids = head.target_ids.cpu()
        self.draft_ids = torch.full((self.vocab_size,), -1, dtype=torch.long)  # target id -> draft id, -1 outside
        self.draft_ids[self.target_ids] = torch.arange(len(self.target_ids))
        lean = (head.lean is not None and skips_masked_keys(runner.device)
                and head.dtype == runner.pool.keys.dtype == torch.float32)
        self.layout = HeadLayout(blocks.block_size) if lean else None

    @property
    def is_head(self) -> bool:
        return True

    @property
    def captures(self) -> CaptureSpec:
        """What the target's forward keeps for the head: its three layers' states, where the target computes them (a
        prompt prefix served from the KV cache is read with zeros: computing it again for the head would cost a batch
        of 16 MT-Bench prompts, which share their template's opening, 4 % of its time)."""
        return CaptureSpec(hidden_layers=self.target_layers, skips_cached_prefix=True)

    @torch.inference_mode()
    def fuse(self, target_states: torch.Tensor) -> torch.Tensor:
        """[n, 3 * hidden] the target's captured states -> [n, hidden] what a head entry reads, on the host."""
        return self.model.fuse(target_states).float().cpu()

    def run(
        self, chains: list[tuple[str, list[int], int]], features: list[torch.Tensor],
        trees: list[TreeRows | None] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Chains as `__call__` takes them, FEATURES [len(tokens), hidden] what each chain's tokens read -> per chain
        [1, draft vocab] logits at its last token, and [1, hidden] the head's output there: through the head's lean
        layer where it runs (engine/model/head_layout.py), else through the packed runner. TREES (the lean layer
        only): per chain, None or where its rows lie as tree nodes (`TreeRows`), whose every row's logits and output
        come back."""
        self._count(chains)
        if self.layout is not None:
            return self._run_lean(chains, features, trees or [None] * len(chains))
        assert not trees or not any(trees), "tree spans need the head's lean layer"
        items = []
        for request_id, token_ids, start in chains:
            item = chain_item(token_ids, start, self.blocks.block_tables[request_id], self.blocks.block_size)
            item.hidden_rows = [len(token_ids) - 1]
            items.append(item)
        out = self.runner.execute(ForwardBatch(items, CaptureSpec(hidden_layers=(1,)), torch.cat(features)))
        return list(out.logits), [hidden[-1:] for hidden in out.hidden]

    @property
    def drafts_trees(self) -> bool:
        """Whether `run` lays out tree spans (the lean layer on the CPU)."""
        return self.layout is not None

    def make_room(self, request_id: str, num_positions: int) -> int:
        """Grow the request's blocks towards NUM_POSITIONS positions (a tree's nodes are written past its drafted
        chain's), as far as free blocks allow; returns the positions covered. The next step's update gives back what
        the target does not accept."""
        return self.blocks.grow_towards(request_id, num_positions)

    def _run_lean(
        self, chains: list[tuple[str, list[int], int]], features: list[torch.Tensor], trees: list[TreeRows | None],
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        tables = self.blocks.block_tables
        token_ids, positions, write_slots, kept_rows, counts, spans = self.layout.lay_out(
            [(tokens, start, tables[request_id], tree) for (request_id, tokens, start), tree in zip(chains, trees)])
        logits, outputs = self.model.forward_rows(token_ids, positions, torch.cat(features), write_slots, spans,
                                                  self.runner.pool, kept_rows)
        return list(logits.split(counts)), list(outputs.split(counts))

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., draft vocab] -> [..., vocab] float32, -inf at the target tokens the head never drafts."""
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"), dtype=torch.float32)
        full[..., self.target_ids] = logits.float()
        return full
