"""Start-up profile of forward latency against the number of tokens in the forward."""
from __future__ import annotations

import statistics
import time

import torch

from engine.kv_cache import RequestKVCache
from engine.runner import ModelRunner

PROFILE_TOKEN_COUNTS = (1, 2, 3, 4, 6, 8, 11, 16)
PROFILE_CONTEXT_LEN = 512
PROFILE_REPEATS = 5


@torch.inference_mode()
def profile_forward_latency(runner: ModelRunner, vocab_size: int, max_model_len: int) -> dict[int, float]:
    """Median seconds of a forward over n new tokens after a fixed context, for each profiled n."""
    context_len = min(PROFILE_CONTEXT_LEN, max_model_len - max(PROFILE_TOKEN_COUNTS))
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab_size, (context_len,), generator=generator).tolist()
    cache = RequestKVCache()
    runner.forward_tokens(cache, context, num_logits=1)
    result = {}
    for num_tokens in PROFILE_TOKEN_COUNTS:
        tokens = context[:num_tokens]
        timings = []  # seconds
        for _ in range(PROFILE_REPEATS):
            cache.truncate(context_len)
            start = time.perf_counter()
            runner.forward_tokens(cache, tokens, num_logits=num_tokens)
            _synchronize(runner.device)
            timings.append(time.perf_counter() - start)
        result[num_tokens] = statistics.median(timings)
    return result


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
