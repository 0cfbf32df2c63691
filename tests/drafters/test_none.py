"""`--drafter none`: plain decoding through the same Drafter contract as every other drafter."""
from types import SimpleNamespace

from drafters.base import CaptureSpec
from drafters.none import NoDrafter


def test_it_proposes_an_empty_draft_for_every_request_and_keeps_no_state():
    drafter = NoDrafter()
    reqs = [SimpleNamespace(request_id=f"r{i}", all_token_ids=[1, 2, 3, 1, 2], num_computed_tokens=5) for i in range(3)]
    for req in reqs:
        drafter.begin(req, None)
        drafter.extend(req, [3])
    drafts = drafter.propose(reqs)
    assert [len(draft) for draft in drafts] == [0, 0, 0] and {draft.source for draft in drafts} == {"none"}
    assert drafter.captures == CaptureSpec() and not drafter.captures.wants_any
    assert drafter.distributions(reqs[0]) is None and drafter.state_bytes() == 0
    assert drafter.finish(reqs[0]) is None
