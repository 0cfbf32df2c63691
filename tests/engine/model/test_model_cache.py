"""A GGUF model's dequantized cache: built once and atomically, and lossless for the embedded default model."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

import engine.model.gguf_cache as gguf_cache
from engine.config import ModelConfig
from engine.model.gguf_cache import dequantized_dir, loadable_source
from engine.model.model_source import DEFAULT_MODEL_NAME, ModelSource, resolve_model_source

TEXTS = [
    "Hello, world!",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Unicode: café, naïve, 日本語, emoji 🎉 and Ωmega",
    "def f(x):\n    return x ** 2  # code",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n<|endoftext|>",
]
MESSAGES = [
    {"role": "user", "content": "Name three colours."},
    {"role": "assistant", "content": "Red, green and blue."},
    {"role": "user", "content": "And three more?"},
]


@pytest.fixture
def tiny_gguf(tmp_path) -> ModelSource:
    gguf = tmp_path / "models" / "tiny.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF v1")
    return ModelSource("tiny", str(gguf.parent), gguf.name)


@pytest.fixture
def fake_saves(monkeypatch) -> list[Path]:
    """Stands in for the real (25 s) dequantization; records the folders it wrote."""
    saved = []

    def fake_save(source: ModelSource, directory: Path) -> None:
        time.sleep(0.1)  # long enough for concurrent builders to overlap
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")
        saved.append(directory)

    monkeypatch.setattr(gguf_cache, "save_dequantized", fake_save)
    return saved


def test_concurrent_builders_build_once_and_leave_only_the_checkpoint(tiny_gguf, fake_saves, tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    (root / ".tiny.Q4_1.partial-999999").mkdir()  # left by a build that was killed
    results = []
    threads = [threading.Thread(target=lambda: results.append(dequantized_dir(tiny_gguf, root))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [root / "tiny.Q4_1"] * 4 and len(fake_saves) == 1
    assert sorted(p.name for p in root.iterdir()) == ["tiny.Q4_1"]
    assert sorted(p.name for p in (root / "tiny.Q4_1").iterdir()) == ["config.json", gguf_cache.STAMP_FILE]


def test_a_changed_gguf_replaces_the_stale_checkpoint(tiny_gguf, fake_saves, tmp_path):
    target = dequantized_dir(tiny_gguf, tmp_path / "cache")
    (target / "stale-marker").write_text("old")
    assert dequantized_dir(tiny_gguf, tmp_path / "cache") == target and len(fake_saves) == 1
    (Path(tiny_gguf.path) / tiny_gguf.gguf_file).write_bytes(b"GGUF v2, another size")
    assert dequantized_dir(tiny_gguf, tmp_path / "cache") == target and len(fake_saves) == 2
    assert not (target / "stale-marker").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tiny.Q4_1"]


def test_loadable_source_keeps_the_name_and_drops_the_gguf_file(tiny_gguf, fake_saves, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    source = loadable_source(tiny_gguf)
    assert source == ModelSource("tiny", str(tmp_path / "xdg" / "specserve" / "dequantized" / "tiny.Q4_1"))
    plain = ModelSource("m", str(tmp_path))
    assert loadable_source(plain) is plain


def test_an_unwritable_cache_falls_back_to_the_gguf(tiny_gguf, fake_saves, tmp_path, monkeypatch, caplog):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))
    with caplog.at_level(logging.WARNING, logger="specserve.engine"):
        assert loadable_source(tiny_gguf) == tiny_gguf
    assert "loading the GGUF file directly" in caplog.text and not fake_saves


@pytest.fixture(scope="module")
def default_source() -> ModelSource:
    return resolve_model_source(None)


@pytest.mark.slow
def test_the_cached_default_model_is_the_gguf_model(default_source):
    from transformers import AutoModelForCausalLM

    from engine.model.model_loader import _eos_token_ids, load_model

    loaded = load_model(ModelConfig(model=None, device="cpu", weights="float32"))  # the dequantized cache itself
    assert loaded.source == default_source and loaded.source.name == DEFAULT_MODEL_NAME
    assert loaded.model.config._name_or_path == str(dequantized_dir(default_source))
    gguf = AutoModelForCausalLM.from_pretrained(
        default_source.path, gguf_file=default_source.gguf_file, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    cached_weights, gguf_weights = loaded.model.state_dict(), gguf.state_dict()
    assert cached_weights.keys() == gguf_weights.keys()
    assert all(
        cached_weights[k].dtype == torch.float32 and torch.equal(cached_weights[k], gguf_weights[k])
        for k in gguf_weights
    )
    input_ids = torch.arange(1, 200).unsqueeze(0) * 97 % 49152  # [1, 199]
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids).logits, gguf(input_ids).logits)
    assert loaded.eos_token_ids == _eos_token_ids(gguf) == [2]
    assert loaded.model.generation_config.to_dict() == gguf.generation_config.to_dict()
    differing = {k for k in gguf.config.to_dict().keys() | loaded.model.config.to_dict().keys()
                 if gguf.config.to_dict().get(k) != loaded.model.config.to_dict().get(k)}
    assert differing <= {"_name_or_path", "architectures", "quantization_config"}


@pytest.mark.slow
def test_the_cached_default_tokenizer_is_the_gguf_tokenizer(default_source):
    from transformers import AutoTokenizer

    from engine.model.tokenizer import load_tokenizer

    cached = load_tokenizer(ModelConfig(model=None))
    assert cached.name_or_path == str(dequantized_dir(default_source))
    gguf = AutoTokenizer.from_pretrained(default_source.path, gguf_file=default_source.gguf_file)
    assert type(cached) is type(gguf)
    assert cached.get_vocab() == gguf.get_vocab()
    assert cached.chat_template == gguf.chat_template and cached.chat_template
    assert cached.special_tokens_map == gguf.special_tokens_map
    assert ((cached.eos_token_id, cached.bos_token_id, cached.pad_token_id)
            == (gguf.eos_token_id, gguf.bos_token_id, gguf.pad_token_id))
    for text in TEXTS:
        for add_special_tokens in (True, False):
            ids = cached(text, add_special_tokens=add_special_tokens)["input_ids"]
            assert ids == gguf(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert cached.decode(ids) == gguf.decode(ids)
    for add_generation_prompt in (True, False):
        rendered = cached.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert rendered == gguf.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert (
            cached(rendered, add_special_tokens=False)["input_ids"]
            == gguf(rendered, add_special_tokens=False)["input_ids"]
        )
