"""bench cpu-layouts on the tiny model: an engine with the layout in use beside one with the layout it replaced, their
forwards timed in turns."""
import pytest
import torch

from bench.cpu_layouts import _engines, markdown, measure
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.model.blocks import BlockWeights
from tests.engine.helpers import gguf_param


def config_for(model_dir, weights: str = "auto") -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=model_dir, device="cpu", weights=weights), cache=CacheConfig(0.05),
                        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512))


def test_the_kv_pool_engines_differ_in_layout_and_every_case_is_timed_for_both(tiny_model_dir):
    engines = _engines(config_for(tiny_model_dir), "kv-pool")
    assert engines["before"].runner.pool.keys.is_contiguous()
    assert engines["now"].runner.pool.keys.transpose(1, 2).is_contiguous()
    free = {name: engine.scheduler.blocks.num_free_blocks for name, engine in engines.items()}
    rows = measure(engines, batch_size=2, context_len=40, new_tokens=[1, 3], vocab_size=engines["now"].vocab_size)
    assert [(row["batch_size"], row["context_len"], row["new_tokens"]) for row in rows] == [(2, 40, 1), (2, 40, 3)]
    assert all(row["before_ms"] > 0 and row["now_ms"] > 0 for row in rows)
    assert {name: engine.scheduler.blocks.num_free_blocks for name, engine in engines.items()} == free  # all freed
    table = markdown({"command": "specserve bench cpu-layouts --compare kv-pool", "compare": "kv-pool",
                      "now": "head-major", "before": "slot-major", "repeats": 1, "threads": 2, "summary": rows})
    assert "| 2 | 40 | 3 |" in table and "slot-major ms" in table


@pytest.mark.parametrize("weights", [gguf_param()])
def test_the_scales_engines_differ_in_the_scales_dtype(tiny_model_dir, weights, monkeypatch):
    """The tiny model's weights rounded to blocks whose scales are halves, as a GGUF's Q4_1 blocks are."""
    by_range = BlockWeights.by_range.__func__

    def with_half_scales(cls, weight):
        blocks = by_range(cls, weight)
        return BlockWeights(blocks.codes, blocks.scales.half().float(), blocks.mins.half().float(), bits=blocks.bits)

    monkeypatch.setattr(BlockWeights, "by_range", classmethod(with_half_scales))
    engines = _engines(config_for(tiny_model_dir, weights), "scales")
    dtypes = {name: engine.runner.decoder.layers[0].gate_up.scales.dtype for name, engine in engines.items()}
    assert dtypes == {"before": torch.float32, "now": torch.float16}


@pytest.mark.parametrize("weights", [gguf_param()])
def test_the_amx_engines_differ_in_the_block_kernels_variant(tiny_model_dir, weights, monkeypatch):
    """As served, the best variant this CPU has; the engine it is compared with, VNNI's (where this CPU has it)."""
    from engine.model.cpu_kernels import ISAS, isa_supported

    monkeypatch.delenv("SPECSERVE_CPU_ISA", raising=False)
    engines = _engines(config_for(tiny_model_dir, weights), "amx")
    isas = {name: engine.runner.decoder.layers[0].gate_up.isa for name, engine in engines.items()}
    best = next(isa for isa in ISAS if isa_supported(isa))
    assert isas == {"before": "avx512vnni" if isa_supported("avx512vnni") else best, "now": best}
