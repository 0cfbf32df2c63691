"""One packed forward over a batch of forward items (engine/model/forward.py), their KV in the paged pool.

The runner takes everything from its input: tokens, positions, slots, block tables,
attention structure, the rows to return and the captures. It reads no scheduler
object and allocates nothing. The layout carries every query's and key's position, so each layer can narrow its
attention to its own sliding window (engine/model/attention_layout.py).
"""
from __future__ import annotations

import torch

from engine.model.attention_layout import (
    MAX_PAGED_ROWS_QUERY_LEN,
    FlashMetadata,
    GroupMember,
    MaskPositions,
    ancestor_matrix,
    build_group,
    contiguous_first_slot,
    in_place_span,
    member_positions,
    needs_positions,
    padded_key_len,
    paged_rows,
    query_mask,
    tree_paths,
)
from engine.model.cuda_graphs import CudaGraphs
from engine.model.decoder import LeanDecoder, supports
from engine.model.forward import ForwardBatch, ForwardItem, ForwardOutput
from engine.model.paged_attention import (
    ATTENTION_NAME,
    MAX_GROUPED_QUERY_LEN,
    AttentionCapture,
    PackedBatch,
    PagedKVPool,
    skips_masked_keys,
)
from engine.sampler import greedy_token_tensor, inverse_cdf_tensor, target_probs

# A long prefill chunk whose context is at least this long is read in place when its slots are contiguous, and so is
# a short run (decoding, verifying drafts) when it is the step's only one. Short runs of several requests are gathered
# into one call, which costs less than one call per request, while a request decoding alone saves the gather. Where
# attention skips masked keys (the CPU row kernel) the padding keys cost nothing and the kernel reads each key at its
# block table's slot, so every sequence, short runs of several requests included, is read in place wherever its
# blocks lie (all of a step's in one C++ call, no keys copied).
IN_PLACE_MIN_CONTEXT = 256
TRITON_MAX_QUERY_LEN = MAX_PAGED_ROWS_QUERY_LEN  # trees this small go through the Triton kernel
# Chains this long go through it too (prefill chunks included, so a step that holds one can replay a CUDA graph): each
# row reads its keys itself, so a longer chunk, which reads every key once per row, goes to SDPA, whose kernels read
# each key once per tile of rows.
TRITON_MAX_CHAIN_LEN = 512


class PackedModelRunner:
    def __init__(
        self, model: torch.nn.Module, device: torch.device, pool: PagedKVPool, block_size: int, backend: str = "sdpa",
        in_place_min_context: int | None = None,  # None: 0 where attention skips masked keys, else IN_PLACE_MIN_CONTEXT
    ) -> None:
        self.model = model
        self.device = device
        self.pool = pool
        self.block_size = block_size
        self.backend = backend
        if in_place_min_context is None:
            in_place_min_context = 0 if skips_masked_keys(device) else IN_PLACE_MIN_CONTEXT
        self.in_place_min_context = in_place_min_context
        self.heads_per_kv_head = model.config.num_attention_heads // model.config.num_key_value_heads
        self._hidden_hooks: set[int] = set()  # layers whose output a hook can keep (transformers' forward)
        self._hidden_layers_checked: set[tuple[int, ...]] = set()  # capture layer tuples found valid (and hooked)
        self.decoder = LeanDecoder(model) if supports(model) else None  # else transformers' forward
        self.narrowest_window = _narrowest_window(self.decoder, model)
        self.graphs: CudaGraphs | None = None  # captured by capture_graphs
        # a sampled request's rows sampled here (engine/engine.py `_sample_on_device`) on a GPU; on the CPU the
        # verifier samples only the rows its walk reaches (every row of a tree costs a pass over the vocabulary)
        self.samples_on_device = device.type != "cpu"
        model.set_attn_implementation(ATTENTION_NAME)

    def capture_graphs(self, spare_block: int, max_blocks: int, max_tokens: int) -> bool:
        """Capture CUDA graphs of decoding and verifying steps (engine/model/cuda_graphs.py) where they apply: on a
        GPU, with the lean decoder and the triton backend. SPARE_BLOCK: a pool block no sequence owns (the padding
        rows' KV); MAX_BLOCKS: the widest block table; MAX_TOKENS: the largest step captured. Returns whether it
        captured."""
        if self.device.type != "cuda" or self.decoder is None or self.backend != "triton" or max_tokens < 1:
            return False
        self.graphs = CudaGraphs(self.decoder, self.pool, self.block_size, spare_block, max_blocks, self.device,
                                 max_tokens, self.paged_rows_fit)
        self.graphs.capture()
        return True

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> ForwardOutput:
        packed, logits = self.forward_logits(batch)
        return self._output(batch, packed, logits)

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> tuple[PackedBatch, torch.Tensor]:
        """The forward itself: every item's logit rows, then its drafter rows, then its prompt rows, as [rows, vocab]
        on the device in the model's dtype (the captures stay in the packed batch)."""
        if self.graphs is not None and self.graphs.fits(batch):
            return PackedBatch(self.pool, self.block_size, self._tensor([])), self.graphs.forward_logits(batch)
        items = batch.items
        starts = _starts(items)
        members = [_member(item, start) for item, start in zip(items, starts)]
        packed = PackedBatch(self.pool, self.block_size, self._tensor([s for item in items for s in item.slots]))
        self._lay_out(packed, items, members)
        self._ask_captures(packed, batch, members)
        rows = self._tensor([start + row for item, start in zip(items, starts) for row in _logit_rows(item)])
        token_ids = self._tensor([t for item in items for t in item.token_ids])
        positions = self._tensor([p for item in items for p in item.positions])
        if self.decoder is not None:
            return packed, self.decoder(token_ids, positions, rows, packed)
        features = {} if batch.features is None else {"features": batch.features.to(self.device)}
        return packed, self.model(
            input_ids=token_ids[None], position_ids=positions[None], use_cache=False, logits_to_keep=rows,
            packed_batch=packed, **features,
        ).logits[0]

    def move_kv(self, moves: list[tuple[int, int]]) -> None:
        """Copy KV between slots in every layer, in order: an accepted draft branch to its final positions."""
        if moves:
            self.pool.move(moves)

    # --- attention layout ------------------------------------------------------------------
    def _lay_out(self, packed: PackedBatch, items: list[ForwardItem], members: list[GroupMember]) -> None:
        if self.backend == "triton":
            items, members = self._lay_out_paged_rows(packed, items, members)
        chains = [members[i] for i, item in enumerate(items) if item.is_chain]
        if self.backend == "flash" and chains:
            packed.flash = self._flash_metadata(chains)
            chains = []  # trees: SDPA, in the same step
        trees, gathered = self._lay_out_trees(items, members)
        sequences = chains + trees
        with_positions = needs_positions(members, self.narrowest_window)
        short = [m for m in sequences if m.query_len <= MAX_GROUPED_QUERY_LEN]
        long = [m for m in sequences if m.query_len > MAX_GROUPED_QUERY_LEN]
        row_kernel = skips_masked_keys(self.device)  # it reads a sequence's keys wherever its blocks lie
        if (len(short) == 1 and not gathered) or row_kernel:
            long, short = long + short, []  # read in place where their slots allow: see IN_PLACE_MIN_CONTEXT
        gathered += short
        for member in long:
            first_slot = None if row_kernel else self._in_place_first_slot(member)
            if member.context_len < self.in_place_min_context or (first_slot is None and not row_kernel):
                gathered.append(member)
            else:
                packed.spans.append(in_place_span(member, first_slot, self.heads_per_kv_head, self.device,
                                                  with_positions, self.block_size if row_kernel else None))
        packed.groups = self._groups(gathered, with_positions)

    def _lay_out_paged_rows(
        self, packed: PackedBatch, items: list[ForwardItem], members: list[GroupMember]
    ) -> tuple[list[ForwardItem], list[GroupMember]]:
        """The Triton kernel's rows: the items `paged_rows_fit`. Returns the items left to the other paths (prefill
        chunks longer than TRITON_MAX_CHAIN_LEN, trees it cannot window)."""
        kernel = [self.paged_rows_fit(item) for item in items]
        entries = [(member.query_start, item) for item, member, fits in zip(items, members, kernel) if fits]
        if entries:
            packed.paged_rows = paged_rows(entries, self.block_size, self.device)
        rest = [i for i, fits in enumerate(kernel) if not fits]
        return [items[i] for i in rest], [members[i] for i in rest]

    def paged_rows_fit(self, item: ForwardItem) -> bool:
        """Whether the Triton kernel attends ITEM's rows (backend triton): a chain of up to TRITON_MAX_CHAIN_LEN
        tokens, or a tree of up to TRITON_MAX_QUERY_LEN where every window is wider than that (a node's new entries
        are not at their positions, so a window cannot be applied to them)."""
        if item.is_chain:
            return item.num_tokens <= TRITON_MAX_CHAIN_LEN
        window = self.narrowest_window
        return item.num_tokens <= TRITON_MAX_QUERY_LEN and (window is None or window > TRITON_MAX_QUERY_LEN)

    def _lay_out_trees(
        self, items: list[ForwardItem], members: list[GroupMember]
    ) -> tuple[list[GroupMember], list[GroupMember]]:
        """The trees as sequences masked to their ancestors where attention skips masked keys, else as the chains of
        their paths, to be gathered (attention_layout.py): (sequences, paths)."""
        trees = [(item, member) for item, member in zip(items, members) if not item.is_chain]
        if not skips_masked_keys(self.device):
            return [], [path for item, member in trees for path in tree_paths(member, item.parents, item.slots)]
        for item, member in trees:
            member.ancestors = ancestor_matrix(item.parents)
        return [member for _, member in trees], []

    def _in_place_first_slot(self, member: GroupMember) -> int | None:
        first_slot = contiguous_first_slot(member.block_table, member.context_len, self.block_size)
        if first_slot is None or first_slot + padded_key_len(member.context_len) > self.pool.keys.shape[1]:
            return None  # the padding keys would run past the pool
        return first_slot

    def _groups(self, members: list[GroupMember], with_positions: bool) -> list:
        """Short sequences (decoding, verifying drafts) share one attention call; each long prefill chunk has its
        own."""
        short = [m for m in members if m.query_len <= MAX_GROUPED_QUERY_LEN]
        long = [[m] for m in members if m.query_len > MAX_GROUPED_QUERY_LEN]
        return [
            build_group(group, self.block_size, self.heads_per_kv_head, self.device, with_positions)
            for group in ([short] if short else []) + long
        ]

    def _flash_metadata(self, members: list[GroupMember]) -> FlashMetadata:
        tables = [m.block_table for m in members]
        width = max(len(table) for table in tables)
        return FlashMetadata(
            query_index=self._tensor([m.query_start + i for m in members for i in range(m.query_len)]),
            cu_seqlens_q=self._cumulative([m.query_len for m in members]),
            cu_seqlens_k=self._cumulative([m.context_len for m in members]),
            max_seqlen_q=max(m.query_len for m in members),
            max_seqlen_k=max(m.context_len for m in members),
            block_table=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=self.device
            ),
        )

    # --- captures --------------------------------------------------------------------------
    def _ask_captures(self, packed: PackedBatch, batch: ForwardBatch, members: list[GroupMember]) -> None:
        capture = batch.capture
        if capture.hidden_layers:
            hidden_rows = [m.query_start + row for item, m in zip(batch.items, members) for row in item.hidden_rows]
            if hidden_rows:
                self._check_hidden_layers(capture.hidden_layers)
                packed.hidden_layers, packed.hidden_index = capture.hidden_layers, self._tensor(hidden_rows)
                packed.hidden_every_row = hidden_rows == list(range(len(packed.write_slots)))
        for layer, head in capture.attention_heads:
            packed.capture_heads.setdefault(layer, []).append(head)
        if packed.capture_heads:
            packed.attention_captures = [
                self._attention_capture(i, item, member)
                for i, (item, member) in enumerate(zip(batch.items, members)) if item.attention_rows
            ]

    def _check_hidden_layers(self, layers: tuple[int, ...]) -> None:
        """Refuse capture layers the model lacks and hook those transformers' forward must keep; once per tuple (a
        drafter asks for the same layers every step)."""
        if layers in self._hidden_layers_checked:
            return
        num_layers = self.model.config.num_hidden_layers
        if not all(1 <= layer <= num_layers for layer in layers):
            raise ValueError(f"hidden-state captures need layers in [1, {num_layers}]")
        if self.decoder is None:  # the lean decoder keeps them itself
            for layer in layers:
                self._ensure_hidden_hook(layer)
        self._hidden_layers_checked.add(layers)

    def _attention_capture(self, index: int, item: ForwardItem, member: GroupMember) -> AttentionCapture:
        num_blocks = -(-item.context_len // self.block_size)
        ancestors = ancestor_matrix(item.parents) if item.parents is not None else None
        mask = query_mask(member, item.num_tokens, item.context_len, ancestors)[item.attention_rows]
        queries, keys = member_positions(member, item.context_len)
        return AttentionCapture(
            index, self._tensor([member.query_start + row for row in item.attention_rows]),
            self._tensor(item.block_table[:num_blocks]), item.context_len, mask.to(self.device),
            MaskPositions.of(queries[item.attention_rows, None], keys[None]),
        )

    def _ensure_hidden_hook(self, hidden_layer: int) -> None:
        """A hook on decoder layer HIDDEN_LAYER - 1 keeps its output at the asked rows (transformers' hidden_states
        index: 1 = after the first layer) when a batch captures that layer. The batch travels in the layer's kwargs,
        so the hook holds no state."""
        if hidden_layer in self._hidden_hooks:
            return

        def keep_rows(module, args, kwargs, output) -> None:
            packed = kwargs.get("packed_batch")
            if packed is not None:
                hidden = output[0] if isinstance(output, tuple) else output  # [(1,) total, hidden_size]
                packed.keep_hidden(hidden_layer, hidden.reshape(-1, hidden.shape[-1]))

        self.model.model.layers[hidden_layer - 1].register_forward_hook(keep_rows, with_kwargs=True)
        self._hidden_hooks.add(hidden_layer)

    # --- output ------------------------------------------------------------------------------
    def _output(self, batch: ForwardBatch, packed: PackedBatch, logits: torch.Tensor) -> ForwardOutput:
        """logits [rows kept, vocab] on the device -> per item its verifier rows (or their chosen tokens), drafter
        rows, hidden states and attention rows."""
        out = ForwardOutput([], [], [], [])
        host_logits, chosen = _to_host(batch, logits)
        hidden = packed.hidden_states()
        logit_start = hidden_start = device_start = 0
        for i, item in enumerate(batch.items):
            num_logits, num_drafter, num_prompt = len(item.logit_rows), len(item.drafter_rows), len(item.prompt_rows)
            device_start += num_logits + num_drafter
            out.prompt_logits.append(logits[device_start:device_start + num_prompt] if num_prompt else None)
            device_start += num_prompt
            out.chosen.append(chosen.get(i))
            if item.choice is not None:
                out.logits.append(None)
                num_logits = 0
            else:
                out.logits.append(host_logits[logit_start:logit_start + num_logits])
            drafter = host_logits[logit_start + num_logits:logit_start + num_logits + num_drafter]
            out.drafter_logits.append(drafter if num_drafter else None)
            logit_start += num_logits + num_drafter
            num_hidden = len(item.hidden_rows) if packed.hidden_index is not None else 0
            out.hidden.append(hidden[hidden_start:hidden_start + num_hidden] if num_hidden else None)
            hidden_start += num_hidden
            out.attention.append(
                self._item_attention(batch, packed, i) if item.attention_rows and packed.capture_heads else None
            )
        return out

    @staticmethod
    def _item_attention(batch: ForwardBatch, packed: PackedBatch, index: int) -> torch.Tensor:
        """[rows, num capture heads, context_len], the heads in the order the capture spec lists them."""
        per_head = [
            packed.captured_attention[(index, layer)][:, packed.capture_heads[layer].index(head)]
            for layer, head in batch.capture.attention_heads
        ]
        return torch.stack(per_head, dim=1).cpu()

    def _cumulative(self, lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0] + lengths, dtype=torch.int32, device=self.device).cumsum(0, dtype=torch.int32)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _logit_rows(item: ForwardItem) -> list[int]:
    """The rows of ITEM whose logits the forward keeps, in the order the output reads them."""
    return item.logit_rows + item.drafter_rows + item.prompt_rows


def _to_host(batch: ForwardBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[int, list[int]]]:
    """What of LOGITS [rows kept, vocab] the host needs: float32 logits of the logit and drafter rows but the logit
    rows of items with a choice, and those items' chosen tokens by item index, chosen where the logits are (one
    transfer each). Prompt rows stay on the device (engine/logprobs.py reduces them there)."""
    if not any(item.choice is not None or item.prompt_rows for item in batch.items):
        return logits.float().cpu(), {}
    greedy_rows, host_rows, sampled, row = [], [], [], 0
    for index, item in enumerate(batch.items):
        rows = list(range(row, row + len(item.logit_rows)))
        if item.choice is None:
            host_rows += rows
        elif item.choice.greedy:
            greedy_rows += rows
        else:
            sampled.append((index, rows))
        host_rows.extend(range(row + len(rows), row + len(rows) + len(item.drafter_rows)))
        row += len(rows) + len(item.drafter_rows) + len(item.prompt_rows)
    parts = [greedy_token_tensor(_rows(logits, greedy_rows))] if greedy_rows else []
    for index, rows in sampled:
        choice = batch.items[index].choice
        parts.append(inverse_cdf_tensor(target_probs(_rows(logits, rows), choice), choice.uniforms))
    tokens = torch.cat(parts).tolist() if parts else []
    chosen, start = {}, 0
    for index, item in enumerate(batch.items):  # greedy items' tokens first, in item order, then the sampled ones'
        if item.choice is not None and item.choice.greedy:
            chosen[index], start = tokens[start:start + len(item.logit_rows)], start + len(item.logit_rows)
    for index, rows in sampled:
        chosen[index], start = tokens[start:start + len(rows)], start + len(rows)
    host = _rows(logits, host_rows).float().cpu() if host_rows else logits.new_empty(0, 0).float()
    return host, chosen


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """LOGITS' ROWS, the tensor itself (no copy) when they are all of its rows in order."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]


def _starts(items: list[ForwardItem]) -> list[int]:
    starts, total = [], 0
    for item in items:
        starts.append(total)
        total += item.num_tokens
    return starts


def _narrowest_window(decoder: LeanDecoder | None, model: torch.nn.Module) -> int | None:
    """The narrowest sliding window of the lean DECODER's layers (None: no layer has one). transformers' forward
    gives its layers' windows to attention as it calls it: 0, so every layout records its positions, unless MODEL
    says it has none (`narrowest_window`, an EAGLE-3 head's)."""
    if decoder is None:
        return getattr(model, "narrowest_window", 0)
    windows = [layer.sliding_window for layer in decoder.layers if layer.sliding_window is not None]
    return min(windows) if windows else None


def _member(item: ForwardItem, start: int) -> GroupMember:
    return GroupMember(start, item.num_tokens, item.context_len, item.block_table, positions=item.positions)
