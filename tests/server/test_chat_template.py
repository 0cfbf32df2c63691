"""Chat prompt rendering with the embedded model's ChatML template."""
from __future__ import annotations

import pytest

from server.chat import render_chat_prompt
from server.completions import tokenize_prompt
from server.errors import APIError
from server.protocol import ChatMessage


def messages(*pairs):
    return [ChatMessage.model_validate({"role": role, "content": content}) for role, content in pairs]


def test_renders_chatml_with_generation_prompt(tokenizer):
    token_ids = render_chat_prompt(tokenizer, messages(("system", "Be brief."), ("user", "héllo 你好")))
    assert all(isinstance(t, int) for t in token_ids)
    assert tokenizer.decode(token_ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhéllo 你好<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_developer_is_system_and_text_parts_are_joined(tokenizer):
    parts = [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]
    developer = render_chat_prompt(tokenizer, messages(("developer", parts), ("user", "q")))
    system = render_chat_prompt(tokenizer, messages(("system", "line one\nline two"), ("user", "q")))
    assert developer == system


def test_earlier_assistant_turns_are_rendered(tokenizer):
    turns = messages(("user", "a"), ("assistant", "b"), ("user", "c"))
    text = tokenizer.decode(render_chat_prompt(tokenizer, turns))
    assert text.endswith("<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n")


def test_a_model_without_chat_template_is_400():
    class NoTemplate:
        chat_template = None

    with pytest.raises(APIError) as info:
        render_chat_prompt(NoTemplate(), messages(("user", "x")))
    assert (info.value.status_code, info.value.param) == (400, "messages")


def test_text_prompt_tokenization(tokenizer):
    assert tokenize_prompt(tokenizer, "héllo") == tokenizer.encode("héllo")
    assert tokenize_prompt(tokenizer, [5, 6]) == [5, 6]
    with pytest.raises(APIError):
        tokenize_prompt(tokenizer, "")
