"""EAGLE-3 draft heads: one decoder layer fed the target's own hidden states, drafting over a reduced vocabulary.

A head is a folder in the public EAGLE-3 layout that SpecForge writes and vLLM and SGLang read:
`config.json` (architectures `LlamaForCausalLMEagle3`: a Llama config of one layer with `draft_vocab_size`, and
optionally `target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`) and `model.safetensors` with
`fc` (the three target layers' states, concatenated low to high, to one hidden vector), `midlayer.*` (the layer: its
attention reads [input_layernorm(embedding) | hidden_norm(hidden)], twice the hidden size), `norm`, `lm_head`
(hidden -> draft vocabulary) and `d2t` (draft id -> target id - draft id). `embed_tokens` is optional: without it the
head embeds with the target's own embedding, as vLLM and SGLang do.

The target layers a head reads are the residual stream after `id` decoder layers for each id, vLLM's reading of the
ids (transformers' hidden_states indices); absent, vLLM's default (2, L // 2, L - 3) of a target with L layers.

How the head runs here (HeadForward, engine/model/draft_model.py): its entry for the token at position p reads the
target's fused state at p - 1, or, for a drafted token, the head's own output (before its final norm) at p - 1; the
first position of a sequence reads zeros. EAGLE-3 trains the same pairs one position earlier (the state at i with
the token at i + 1 at position i); rotary attention sees only differences of positions, so the shift changes
nothing. Its KV lives in a one-layer paged pool of its own at the slots of the target's block tables.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.model.cpu_kernels import fused_ops_available
from engine.model.decoder import LayerWeights, Norm, rms_norm, rotate, whole_layer_args
from engine.model.paged_attention import PackedBatch, PagedKVPool, in_place_spans, paged_attention
from engine.model.weights import concatenate_linears

HEAD_ARCHITECTURE = "LlamaForCausalLMEagle3"
MIN_ROTATIONS = 1024  # positions of the head's first rotary table
WEIGHTS_FILE = "model.safetensors"


class Eagle3Config(LlamaConfig):
    """A head's config: a Llama config (one layer) that names its own model type, so that nothing mistakes the head
    for a whole Llama (engine/model/decoder.py's lean decoder, for one)."""

    model_type = "llama_eagle3"


def is_eagle3_head(path: str | Path) -> bool:
    """Whether PATH is a folder holding an EAGLE-3 head's config."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    return HEAD_ARCHITECTURE in json.loads(config.read_text()).get("architectures", [])


def read_head_config(path: str | Path) -> Eagle3Config:
    values = json.loads((Path(path) / "config.json").read_text())
    values.pop("model_type", None)
    return Eagle3Config(**values)


def aux_layers(config: Eagle3Config, target_num_layers: int) -> tuple[int, ...]:
    """The target layer counts whose residual streams the head reads, low to high."""
    eagle = getattr(config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    layers = tuple(ids) if ids else (2, target_num_layers // 2, target_num_layers - 3)
    if len(layers) != 3 or not all(1 <= layer <= target_num_layers for layer in layers):
        raise ValueError(f"an EAGLE-3 head reads three target layers in [1, {target_num_layers}], not {layers}")
    return layers


class HeadAttention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        wide = 2 * config.hidden_size  # [embedding | hidden]
        self.q_proj = nn.Linear(wide, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(wide, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(wide, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
        """x [total, 2 * hidden] -> [total, hidden]; the keys and values go to layer 0 of the head's pool."""
        total = x.shape[0]
        query = rotate(self.q_proj(x).view(total, self.num_heads, self.head_dim), cos, sin)
        key = rotate(self.k_proj(x).view(total, self.num_kv_heads, self.head_dim), cos, sin)
        value = self.v_proj(x).view(total, self.num_kv_heads, self.head_dim)
        out = paged_attention(0, query, key.to(packed.pool.keys.dtype), value.to(packed.pool.keys.dtype),
                              self.scaling, packed)
        return self.o_proj(out.reshape(total, -1).to(x.dtype))


class HeadMLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class HeadLayer(nn.Module):
    """EAGLE-3's midlayer: attention over [input_layernorm(embedding) | hidden_norm(hidden)], added to HIDDEN, then
    the MLP; returns its output before the head's final norm (what the next drafted position reads)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps)
        self.self_attn = HeadAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = HeadMLP(config)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        packed_batch: PackedBatch,
    ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, cos, sin, packed_batch)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class HeadBody(nn.Module):
    """fc, the layer and the final norm; `layers` so that a hidden-state capture of layer 1 keeps the layer's
    output (engine/model/packed_runner.py)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.fc = nn.Linear(3 * target_hidden, config.hidden_size, bias=False)
        self.layers = nn.ModuleList([HeadLayer(config)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)


class LeanHeadLayer:
    """The head's layer as one C++ call: the target's own whole-layer kernel (engine/model/csrc/decoder_layer.cpp),
    whose query, key and value projection reads [input_layernorm(embedding) | hidden_norm(hidden)] as it reads any
    layer's normed input (its width is the projection's), and whose output comes normed by the head's final norm. At
    one row a drafted token's cost is then mostly the head's weights, not a dozen module calls and small operators.
    `build` gives one where the head's Linears are GGUF blocks (the CPU's `gguf` weights) and the C++ operators run,
    else None (the modules' own forward serves)."""

    def __init__(self, body: HeadBody, args: tuple) -> None:
        layer = body.layers[0]
        self.input_norm, self.hidden_norm = layer.input_layernorm, layer.hidden_norm
        self.args = args

    @classmethod
    def build(cls, body: HeadBody) -> LeanHeadLayer | None:
        if not fused_ops_available():
            return None
        layer = body.layers[0]
        attention, mlp, mlp_norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        weights = LayerWeights(
            index=0, input_norm=Norm(layer.input_layernorm.weight, layer.input_layernorm.eps),
            qkv=concatenate_linears([attention.q_proj, attention.k_proj, attention.v_proj]), output=attention.o_proj,
            mlp_norm=Norm(mlp_norm.weight, mlp_norm.eps),
            gate_up=concatenate_linears([mlp.gate_proj, mlp.up_proj]), down=mlp.down_proj,
        )
        args = whole_layer_args(weights, Norm(body.norm.weight, body.norm.eps), attention.num_heads,
                                attention.num_kv_heads, attention.scaling, "silu")
        return None if args is None else cls(body, args)

    def __call__(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        write_slots: torch.Tensor, spans: tuple, pool: PagedKVPool,
    ) -> torch.Tensor:
        """HIDDEN [total, hidden] becomes the layer's output, in place -> that output final-normed. WRITE_SLOTS: the
        rows' slots in POOL; SPANS: the rows' in-place spans (`in_place_spans`)."""
        ops = torch.ops.specserve
        normed = torch.cat((ops.rms_norm(embeds, self.input_norm.weight, self.input_norm.eps),
                            ops.rms_norm(hidden, self.hidden_norm.weight, self.hidden_norm.eps)), dim=-1)
        return ops.decoder_layer(hidden, normed, cos, sin, write_slots, *spans, pool.layer_keys[0],
                                 pool.layer_values[0], *self.args)


@dataclass
class HeadOutput:
    logits: torch.Tensor  # [1, rows, draft vocab]


class Eagle3Head(nn.Module):
    """The head as the packed runner calls a model: token ids and positions of a packed batch, the fused states
    each token reads (`features`, [total, hidden]; zeros where none is given), logits over the draft vocabulary at
    the asked rows. EMBED: the target's embedding module unless the head has its own; it is not the head's
    parameter (the target owns it)."""

    narrowest_window = None  # its attention has no sliding window: layouts need no positions

    def __init__(self, config: Eagle3Config, embed: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.model = HeadBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.__dict__["embed"] = embed  # the target's: kept out of the head's modules and parameters
        self.__dict__["lean"] = None  # a LeanHeadLayer once `make_lean` finds one runs

    def make_lean(self) -> None:
        """Run the layer as one C++ call from now on, where that runs (LeanHeadLayer): after the weights take their
        final form."""
        self.__dict__["lean"] = LeanHeadLayer.build(self.model)

    def set_attn_implementation(self, name: str) -> None:
        """The runner's call for transformers models; the head attends through the paged pool itself."""

    @property
    def target_ids(self) -> torch.Tensor:
        """[draft vocab] the target token id of each draft id."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its residual stream (its Linear layers may keep their weights in another form)."""
        return self.model.norm.weight.dtype

    def fuse(self, target_states: torch.Tensor) -> torch.Tensor:
        """[n, 3 * target hidden] the target's states at the capture layers, concatenated -> [n, hidden]."""
        return self.model.fc(target_states.to(device=self.d2t.device, dtype=self.dtype))

    def _rotation(self, embeds: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [total, 1, head_dim] at POSITION_IDS [1, total], in EMBEDS' dtype: rows of a table the rotary
        embedding computes once for positions 0..n-1 and again, twice as long, when a position passes it (a drafted
        token's forward then indexes two tensors instead of computing the embedding afresh)."""
        index = position_ids[0]
        table = self.__dict__.get("_rotations")
        if table is not None and (index.device.type == "cpu" or int(index.max()) < len(table[0])):
            try:
                return table[0][index, None], table[1][index, None]
            except IndexError:  # a position past the table, on the CPU (on a GPU such an index is fatal: checked)
                pass
        positions = torch.arange(max(2 * int(index.max()) + 2, MIN_ROTATIONS), device=embeds.device)[None]
        table = tuple(t[0].to(embeds.dtype) for t in self.model.rotary_emb(embeds, positions))
        self.__dict__["_rotations"] = table
        return table[0][index, None], table[1][index, None]

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, packed_batch: PackedBatch,
        logits_to_keep: torch.Tensor, features: torch.Tensor | None = None, use_cache: bool = False,
    ) -> HeadOutput:
        dtype = self.dtype
        embeds = self.embed(input_ids[0]).to(dtype)  # [total, hidden]
        hidden = features.to(dtype) if features is not None else torch.zeros_like(embeds)
        cos, sin = self._rotation(embeds, position_ids)
        spans = in_place_spans(packed_batch, None, len(embeds)) if self.lean is not None else None
        if spans is not None and dtype == packed_batch.pool.keys.dtype == torch.float32:
            hidden = hidden.clone()  # the kernel writes the layer's output into it
            normed = self.lean(embeds, hidden, cos, sin, packed_batch.write_slots, spans, packed_batch.pool)
            packed_batch.keep_hidden(1, hidden)
            return HeadOutput(self.lm_head(normed[logits_to_keep])[None])
        out = self.model.layers[0](embeds, hidden, cos, sin, packed_batch=packed_batch)
        return HeadOutput(self.lm_head(self.model.norm(out[logits_to_keep]))[None])

    @torch.inference_mode()
    def forward_rows(
        self, token_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor, write_slots: torch.Tensor,
        spans: tuple, pool: PagedKVPool, last_rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The lean layer's forward of chains laid out by engine/model/head_layout.py (`lean` must be set and the
        pool float32, as the embeddings and FEATURES are): TOKEN_IDS, POSITIONS [rows], FEATURES [rows, hidden] what
        each reads -> (draft-vocabulary logits, the layer's outputs before the final norm) at LAST_ROWS (None: at
        every row)."""
        embeds = self.embed(token_ids)
        hidden = features.clone()  # the kernel writes the layer's output into it
        cos, sin = self._rotation(embeds, positions[None])
        normed = self.lean(embeds, hidden, cos, sin, write_slots, spans, pool)
        if last_rows is not None:
            normed, hidden = normed[last_rows], hidden[last_rows]
        return self.lm_head(normed), hidden


def load_eagle3_head(path: str | Path, embed: nn.Module, dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    """The head in folder PATH (the public layout), in DTYPE on DEVICE, embedding with EMBED unless it has its own."""
    from safetensors.torch import load_file

    config = read_head_config(path)
    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    own_embed = tensors.pop("embed_tokens.weight", None)
    if own_embed is not None:
        embed = nn.Embedding.from_pretrained(own_embed.to(device=device, dtype=dtype))
    tensors.pop("t2d", None)
    head = Eagle3Head(config, embed)
    state = {_module_name(name): tensor for name, tensor in tensors.items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [name for name in missing if not name.startswith("model.rotary_emb")]
    if missing or unexpected:
        raise ValueError(f"{path} is not an EAGLE-3 head this server reads: missing {missing}, unexpected {unexpected}")
    return head.to(device=device, dtype=dtype).eval()


def save_eagle3_head(
    head: Eagle3Head, path: str | Path, target_vocab_size: int, dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Write HEAD to folder PATH in the public layout (no `embed_tokens`: readers take the target's), its weights in
    DTYPE (bfloat16, as public heads ship: half of float32's bytes)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {_file_name(name): _stored(tensor, dtype) for name, tensor in head.state_dict().items()
               if not name.startswith("model.rotary_emb")}
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[head.target_ids.cpu()] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(path / WEIGHTS_FILE))
    values = head.config.to_dict()
    values.update(architectures=[HEAD_ARCHITECTURE], model_type="llama", num_hidden_layers=1)
    theta = (values.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        values["rope_theta"] = theta  # where vLLM and SGLang read it
    for key in ("transformers_version", "_name_or_path"):
        values.pop(key, None)
    (path / "config.json").write_text(json.dumps(values, indent=1, sort_keys=True))


def _stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tensor = tensor.detach().cpu()
    return (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()


def _module_name(file_name: str) -> str:
    if file_name.startswith("midlayer."):
        return "model.layers.0." + file_name[len("midlayer."):]
    if file_name.startswith(("fc.", "norm.")):
        return "model." + file_name
    return file_name


def _file_name(module_name: str) -> str:
    if module_name.startswith("model.layers.0."):
        return "midlayer." + module_name[len("model.layers.0."):]
    return module_name.removeprefix("model.")
