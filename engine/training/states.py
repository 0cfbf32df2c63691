"""The target's states recorded while the engine answers the training prompts, so that no second forward over each
prompt and answer is needed: a drafter that drafts nothing and keeps, per request, the residual streams the served
forwards computed at every committed position (prefill chunks and each decoded token), at the head's three layers and
after the last layer. The last one gives the teacher: the target's final norm and LM head over it are the logits that
position was sampled from. A position's states are those the head reads when serving, from the same forward.

The answer's last token is sampled but never computed, so an answer of n tokens records prompt + n - 1 positions;
the head never reads the last position's state nor learns the token after it, so a zero row stands there.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import torch

from drafters.base import CaptureSpec, Computed, DraftableRequest
from drafters.none import NoDrafter
from engine.engine import Engine
from engine.speculation import Speculation

TEACHER_TOP_K = 32  # the target's most likely draft-vocabulary tokens kept per position


class StateRecorder(NoDrafter):
    """Drafts nothing; per request, the captured states of every position the target committed, in bfloat16."""

    name = "record-states"

    def __init__(self, layers: Sequence[int]) -> None:
        self.captures = CaptureSpec(hidden_layers=tuple(layers))
        self._live: dict[str, list[torch.Tensor]] = {}
        self._positions: dict[str, int] = {}  # per live request, the positions its parts hold (read every step)
        self._finished: dict[str, torch.Tensor] = {}

    def begin(self, req: DraftableRequest, state: object | None = None) -> None:
        self._live[req.request_id], self._positions[req.request_id] = [], 0

    def observe(self, req: DraftableRequest, computed: Computed) -> None:
        if computed.hidden_states is None:
            return
        parts, kept = self._live[req.request_id], self._positions[req.request_id]
        if computed.start < kept:  # preempted, so computed again from its first token
            parts[:] = [torch.cat(parts)[:computed.start]]
        elif computed.start > kept:
            raise RuntimeError(f"{req.request_id}: positions {kept}..{computed.start - 1} were computed unseen")
        parts.append(computed.hidden_states.to(torch.bfloat16))
        self._positions[req.request_id] = computed.start + len(computed.hidden_states)

    def finish(self, req: DraftableRequest) -> object | None:
        parts = self._live.pop(req.request_id)
        del self._positions[req.request_id]
        if parts:
            self._finished[req.request_id] = torch.cat(parts)
        return None

    def take(self, request_id: str) -> torch.Tensor | None:
        """[positions, hidden * layers] what the finished request REQUEST_ID recorded (then forgotten here), None if
        it computed nothing."""
        return self._finished.pop(request_id, None)


@contextmanager
def recording(engine: Engine, layers: Sequence[int]):
    """ENGINE answers with a StateRecorder of LAYERS as its drafter (yielded), its own drafter back afterwards."""
    previous = engine.speculation
    recorder = StateRecorder(layers)
    engine.speculation = Speculation(recorder)
    try:
        yield recorder
    finally:
        engine.speculation = previous


@torch.inference_mode()
def teacher(model: torch.nn.Module, final_states: torch.Tensor, draft_ids: torch.Tensor):
    """FINAL_STATES [T, hidden] the residual stream after the target's last layer -> the target's top TEACHER_TOP_K
    draft ids at each position ([T, K] int32) and their probabilities renormalised over the K ([T, K] float16);
    DRAFT_IDS: [draft vocab] the target id of each draft id."""
    logits = model.lm_head(model.model.norm(final_states.float()))
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    draft_probs = torch.softmax(logits.float()[:, draft_ids], dim=-1)  # in draft id order
    top = draft_probs.topk(min(TEACHER_TOP_K, len(draft_ids)), dim=-1)
    return top.indices.to(torch.int32), (top.values / top.values.sum(-1, keepdim=True)).to(torch.float16)
