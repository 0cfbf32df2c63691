"""vLLM's `/tokenize` and `/detokenize`: the token ids specserve computes for a prompt or a conversation, and the
text of token ids.

The ids are exactly those a completion or chat request would be served with (the same chat template, tools and
special tokens), so a client can count tokens before it sends, and a router that places requests by token prefix
(vLLM's router asks a replica for a request's tokens here when it has no tokenizer of its own) can route a request
to the replica holding the longest prefix of it.
"""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.chat import render_chat_prompt
from server.completions import tokenize_prompt
from server.errors import APIError
from server.protocol import ChatMessage, ToolDefinition
from server.serving import ServingContext


class TokenizeRequest(BaseModel):
    """Either a text prompt (as /v1/completions takes it) or chat messages (as /v1/chat/completions does)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolDefinition] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # None: True for a prompt, the template's own for messages
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.messages is not None and self.continue_final_message:
            raise ValueError("continue_final_message is not supported")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens applies to a prompt; the chat template adds the model's own")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


async def tokenize(context: ServingContext, body: TokenizeRequest) -> JSONResponse:
    ready = context.require_ready()
    context.check_model(body.model, ready)
    tokenizer = context.tokenizer
    if body.messages is not None:
        tokens = render_chat_prompt(tokenizer, body.messages, body.tools, body.add_generation_prompt)
    elif body.add_special_tokens is False:
        tokens = list(tokenizer.encode(body.prompt, add_special_tokens=False))
    else:
        tokens = tokenize_prompt(tokenizer, body.prompt)
    reply: dict[str, Any] = {"count": len(tokens), "max_model_len": ready.max_model_len, "tokens": tokens,
                             "token_strs": tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None}
    return JSONResponse(reply)


async def detokenize(context: ServingContext, body: DetokenizeRequest) -> JSONResponse:
    ready = context.require_ready()
    context.check_model(body.model, ready)
    vocab_size = len(context.tokenizer)
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab_size:
            raise APIError(400, f"tokens[{i}] = {token} is not a token id of this model (0 .. {vocab_size - 1})",
                           param="tokens")
    return JSONResponse({"prompt": context.tokenizer.decode(body.tokens)})
