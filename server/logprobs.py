"""The engine's token log-probabilities (engine/logprobs.py says which distribution) in OpenAI's two shapes.

A token's text is its bytes decoded as UTF-8 (a byte-level BPE token may hold part of
a character: its text then has U+FFFD where the partial bytes are, and `bytes` has
them exactly, as OpenAI reports them).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from engine.wire import TokenLogprob
from server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobList,
    TokenLogprobInfo,
    TopLogprob,
)


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_decoder = _byte_level_decoder()

    def chat(self, entries: list[TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs(content=[self._chat_entry(entry) for entry in entries])

    def completion(self, entries: list[TokenLogprob], text_offset: int = 0) -> CompletionLogprobs:
        """TEXT_OFFSET: where the first token's text starts in the choice's text (streams go on from the last chunk)."""
        out = CompletionLogprobs()
        for entry in entries:
            token = self.token_text(entry.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(entry.logprob)
            out.top_logprobs.append(dict(zip(map(self.token_text, entry.top_token_ids), entry.top_logprobs)))
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out

    def echoed_prompt(
        self, prompt_token_ids: list[int], entries: list[TokenLogprob | None], num_top: int
    ) -> CompletionLogprobs:
        """An echoed prompt in the completions shape: the first token has no log-probability (null, as OpenAI and
        vLLM answer), the others their entry with its NUM_TOP most likely alternatives."""
        first = self.token_text(prompt_token_ids[0])
        rest = self.completion([_with_top(entry, num_top) for entry in entries[1:]], text_offset=len(first))
        return CompletionLogprobs(
            tokens=[first, *rest.tokens], token_logprobs=[None, *rest.token_logprobs],
            top_logprobs=[None, *rest.top_logprobs], text_offset=[0, *rest.text_offset],
        )

    def prompt_logprobs(self, entries: list[TokenLogprob | None], num_top: int) -> PromptLogprobList:
        """vLLM's prompt_logprobs: per prompt token its own entry and its NUM_TOP most likely alternatives', keyed by
        token id."""
        return [self._prompt_entry(_with_top(entry, num_top)) if entry is not None else None for entry in entries]

    def _prompt_entry(self, entry: TokenLogprob) -> dict[str, PromptLogprob]:
        shaped = {
            str(token_id): PromptLogprob(logprob=logprob, rank=rank, decoded_token=self.token_text(token_id))
            for rank, (token_id, logprob) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1)
        }
        shaped[str(entry.token_id)] = PromptLogprob(logprob=entry.logprob, rank=entry.rank or None,
                                                    decoded_token=self.token_text(entry.token_id))
        return shaped

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is not None and all(char in self._byte_decoder for char in piece):
            return bytes(self._byte_decoder[char] for char in piece)
        return self._tokenizer.decode([token_id]).encode("utf-8")  # not byte-level BPE: its decoded text

    def _chat_entry(self, entry: TokenLogprob) -> TokenLogprobInfo:
        token = self.token_bytes(entry.token_id)
        top = [self._top(token_id, logprob) for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs)]
        return TokenLogprobInfo(token=token.decode("utf-8", errors="replace"), logprob=entry.logprob,
                                bytes=list(token), top_logprobs=top)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_bytes(token_id)
        return TopLogprob(token=token.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(token))


def _with_top(entry: TokenLogprob, num_top: int) -> TokenLogprob:
    return TokenLogprob(entry.token_id, entry.logprob, entry.top_token_ids[:num_top], entry.top_logprobs[:num_top],
                        entry.rank)


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: printable bytes stand for themselves, the others for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    decoder = {chr(byte): byte for byte in printable}
    decoder.update({chr(256 + n): byte for n, byte in enumerate(others)})
    return decoder
