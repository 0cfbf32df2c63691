"""bench kv-layout on the tiny model: one engine per pool layout, their forwards timed in turns."""
from bench.kv_layout import _engines, markdown, measure
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def test_each_layout_gets_its_engine_and_every_case_is_timed_for_both(tiny_model_dir):
    config = EngineConfig(model=ModelConfig(model=tiny_model_dir, device="cpu"), cache=CacheConfig(0.05),
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512))
    engines = _engines(config)
    assert engines["slot-major"].runner.pool.keys.is_contiguous()
    assert engines["head-major"].runner.pool.keys.transpose(1, 2).is_contiguous()
    free = {name: engine.scheduler.blocks.num_free_blocks for name, engine in engines.items()}
    rows = measure(engines, batch_size=2, context_len=40, new_tokens=[1, 3],
                   vocab_size=engines["head-major"].vocab_size)
    assert [(row["batch_size"], row["context_len"], row["new_tokens"]) for row in rows] == [(2, 40, 1), (2, 40, 3)]
    assert all(row["slot_major_ms"] > 0 and row["head_major_ms"] > 0 for row in rows)
    assert {name: engine.scheduler.blocks.num_free_blocks for name, engine in engines.items()} == free  # all freed
    table = markdown({"command": "specserve bench kv-layout", "repeats": 1, "threads": 2, "summary": rows})
    assert "| 2 | 40 | 3 |" in table
