"""The CPU attention path of machines without the row kernel (AVX2): batched matmuls whose rows come out bit for
bit the same whatever the padding keys after them."""
import pytest
import torch

import engine.model.paged_attention as paged_attention
from engine.model.attention_layout import KEY_MULTIPLE


@pytest.mark.parametrize("num_keys", [448, 512, 1024])
def test_a_rows_attention_ignores_how_many_padding_keys_follow_its_own(num_keys):
    """A query sees keys 0..376; the call pads the keys to 384 or to NUM_KEYS. Above 384 keys MKL's float32 GEMM on
    some CPUs groups its sum over the keys differently, so one product over all keys would move the row's last
    bits; summing KEY_MULTIPLE keys per product keeps them."""
    torch.manual_seed(7)
    rows, visible, head_dim = 8, 377, 64
    q = torch.randn(2, 3, rows, head_dim)  # [R, kv_heads, rows, head_dim]
    k, v = torch.randn(2, 3, num_keys, head_dim), torch.randn(2, 3, num_keys, head_dim)
    blocked = torch.zeros(2, 1, rows, num_keys, dtype=torch.bool)
    blocked[..., visible:] = True

    def attend(length: int) -> torch.Tensor:
        return paged_attention._row_invariant_attention(
            q, k[:, :, :length], v[:, :, :length], blocked[..., :length], head_dim**-0.5
        )

    assert 384 % KEY_MULTIPLE == 0 and torch.equal(attend(384), attend(num_keys))
