"""The lean decoder's fused operators on a GPU, in Triton: the same four calls, with the same arguments, as the CPU's
C++ ones (engine/model/csrc/fused_ops.cpp), so `LeanDecoder._fused_layer` runs either.

At batch 1 a decoder layer's small operators (norms computed in float32 and cast back, the rotary embedding's halves,
the KV write, the residual adds, the gated activation) are some twenty kernels against four matrix products, and each
costs a few microseconds whatever its size: on an H200 they were a third of an 8B step. Fused, they are four:
- `rms_norm(x, weight, eps)`: one norm (the first layer's input norm);
- `add_rms_norm(hidden, delta, weight, eps, delta_weight, delta_eps)`: hidden += delta (or += rms_norm(delta) by
  DELTA_WEIGHT: Gemma's norms after attention and after the MLP), in place, then returns rms_norm(hidden) by WEIGHT;
- `gated_activation(gate_up, activation)`: act(gate) * up over [.., gate | up];
- `rope_write(qkv, cos, sin, heads, kv_heads, q_weight, k_weight, eps, keys, values, slots)`: per head, the query and
  key norms where given, the rotary embedding of queries and keys, and the keys and values written to the pool at
  SLOTS; returns the queries [T, heads, head_dim].
Arithmetic is float32 with the unfused path's roundings to the model's dtype: a norm's weight in the model's dtype
(Llama) scales after the cast back, a float32 one (Gemma's 1 + weight) before it; the rotary embedding rounds
x cos and rotate_half(x) sin and their sum as torch's three operators do.
Imported only where the decoder runs on a GPU; `TRITON_INTERPRET=1` runs it on a CPU (tests/engine/model).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scaled(x, rstd, w, out_dtype: tl.constexpr, WEIGHT_FIRST_CAST: tl.constexpr):
    """x * rstd * w in OUT_DTYPE: cast, then scale in OUT_DTYPE (a weight in the model's dtype), or scale, then cast."""
    if WEIGHT_FIRST_CAST:
        return ((x * rstd).to(out_dtype).to(tl.float32) * w).to(out_dtype)
    return (x * rstd * w).to(out_dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, eps, stride_x, stride_out, BLOCK: tl.constexpr,
                     WEIGHT_FIRST_CAST: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    y = _scaled(x, rstd, w, out_ptr.dtype.element_ty, WEIGHT_FIRST_CAST)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, dw_ptr, out_ptr, n, eps, delta_eps, stride_h, stride_d, stride_out,
                         BLOCK: tl.constexpr, WEIGHT_FIRST_CAST: tl.constexpr, NORM_DELTA: tl.constexpr,
                         DELTA_WEIGHT_FIRST_CAST: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = h_ptr.dtype.element_ty
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM_DELTA:
        dw = tl.load(dw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        d_rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n + delta_eps)
        d = _scaled(d, d_rstd, dw, dtype, DELTA_WEIGHT_FIRST_CAST).to(tl.float32)
    h = (h + d).to(dtype)
    tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    hf = h.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / n + eps)
    tl.store(out_ptr + row * stride_out + cols, _scaled(hf, rstd, w, out_ptr.dtype.element_ty, WEIGHT_FIRST_CAST),
             mask=mask)


@triton.jit
def _gated_kernel(gu_ptr, out_ptr, n, stride_gu, stride_out, BLOCK: tl.constexpr, GELU: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # tanh(y) = 2 sigmoid(2y) - 1
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    else:
        a = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * stride_out + cols, (a.to(dtype).to(tl.float32) * u).to(dtype), mask=mask)


@triton.jit
def _rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps, q_ptr, k_ptr, v_ptr, slots_ptr,
                       heads, kv_heads, stride_qkv, stride_cos, stride_q_row, stride_q_head, stride_kv_slot,
                       stride_kv_head, head_dim: tl.constexpr, BLOCK_D: tl.constexpr, QK_NORM: tl.constexpr,
                       QK_WEIGHT_FIRST_CAST: tl.constexpr):
    row, head = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    mask = d < head_dim
    half = head_dim // 2
    dtype = qkv_ptr.dtype.element_ty
    base = qkv_ptr + row * stride_qkv + head * head_dim
    x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    if head >= heads + kv_heads:  # a value head: written as it is
        slot = tl.load(slots_ptr + row).to(tl.int64)
        tl.store(v_ptr + slot * stride_kv_slot + (head - heads - kv_heads) * stride_kv_head + d, x.to(dtype),
                 mask=mask)
    else:
        rotated_index = tl.where(d < half, d + half, d - half)
        x_rot = tl.load(base + rotated_index, mask=mask, other=0.0).to(tl.float32)
        if QK_NORM:
            w_ptr = qw_ptr if head < heads else kw_ptr
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / head_dim + eps)
            w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
            w_rot = tl.load(w_ptr + rotated_index, mask=mask, other=0.0).to(tl.float32)
            x = _scaled(x, rstd, w, dtype, QK_WEIGHT_FIRST_CAST).to(tl.float32)
            x_rot = _scaled(x_rot, rstd, w_rot, dtype, QK_WEIGHT_FIRST_CAST).to(tl.float32)
        cos = tl.load(cos_ptr + row * stride_cos + d, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_cos + d, mask=mask, other=0.0).to(tl.float32)
        x_rot = tl.where(d < half, -x_rot, x_rot)
        out = ((x * cos).to(dtype).to(tl.float32) + (x_rot * sin).to(dtype).to(tl.float32)).to(dtype)
        if head < heads:
            tl.store(q_ptr + row * stride_q_row + head * stride_q_head + d, out, mask=mask)
        else:
            slot = tl.load(slots_ptr + row).to(tl.int64)
            tl.store(k_ptr + slot * stride_kv_slot + (head - heads) * stride_kv_head + d, out, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _weight_first_cast(weight: torch.Tensor | None) -> bool:
    return weight is not None and weight.dtype != torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty_like(rows)
    n = rows.shape[1]
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, n, eps, rows.stride(0), out.stride(0),
                                        BLOCK=triton.next_power_of_2(n), WEIGHT_FIRST_CAST=_weight_first_cast(weight))
    return out.view(x.shape)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta_weight: torch.Tensor | None = None, delta_eps: float = 0.0) -> torch.Tensor:
    h, d = _rows(hidden), _rows(delta)
    out = torch.empty_like(h)
    n = h.shape[1]
    _add_rms_norm_kernel[(h.shape[0],)](
        h, d, weight, delta_weight if delta_weight is not None else weight, out, n, eps, delta_eps, h.stride(0),
        d.stride(0), out.stride(0), BLOCK=triton.next_power_of_2(n), WEIGHT_FIRST_CAST=_weight_first_cast(weight),
        NORM_DELTA=delta_weight is not None, DELTA_WEIGHT_FIRST_CAST=_weight_first_cast(delta_weight),
    )
    return out.view(hidden.shape)


GATED_BLOCK = 1024


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"gated_activation: silu or gelu_pytorch_tanh, not {activation}")
    rows = _rows(gate_up)
    n = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], n, dtype=rows.dtype, device=rows.device)
    block = min(GATED_BLOCK, triton.next_power_of_2(n))
    _gated_kernel[(rows.shape[0], triton.cdiv(n, block))](rows, out, n, rows.stride(0), out.stride(0), BLOCK=block,
                                                          GELU=activation == "gelu_pytorch_tanh")
    return out.view(*gate_up.shape[:-1], n)


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
               q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, keys: torch.Tensor,
               values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) head_dim]; cos, sin [T, 1, head_dim]; keys, values [slots, kv_heads, head_dim]."""
    num_tokens, head_dim = qkv.shape[0], keys.shape[2]
    qkv = qkv.contiguous()
    cos, sin = cos.reshape(num_tokens, head_dim).contiguous(), sin.reshape(num_tokens, head_dim).contiguous()
    query = torch.empty(num_tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return query
    _rope_write_kernel[(num_tokens, heads + 2 * kv_heads)](
        qkv, cos, sin, q_weight if q_weight is not None else cos, k_weight if k_weight is not None else cos, eps,
        query, keys, values, slots, heads, kv_heads, qkv.stride(0), cos.stride(0), query.stride(0), query.stride(1),
        keys.stride(0), keys.stride(1), head_dim=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        QK_NORM=q_weight is not None, QK_WEIGHT_FIRST_CAST=_weight_first_cast(q_weight),
    )
    return query
