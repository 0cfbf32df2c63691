"""`specserve serve` flags become the engine's config."""
from server.cli import engine_config
from specserve import build_parser


def test_draft_and_companion_flags_reach_the_engine_config():
    args = build_parser().parse_args([
        "serve", "--drafter", "copyspec+draft", "--draft-model", "early-exit:20", "--companion-model", "early-exit:12",
        "--num-draft-tokens", "7",
    ])
    config = engine_config(args)
    assert (config.model.draft_model, config.model.companion_model) == ("early-exit:20", "early-exit:12")
    assert (config.spec.drafter, config.spec.num_draft_tokens) == ("copyspec+draft", 7)


def test_without_draft_flags_the_engine_owns_the_target_only():
    args = build_parser().parse_args(["serve"])
    config = engine_config(args)
    assert (
        config.model.draft_model is None and config.model.companion_model is None and config.spec.num_draft_tokens == 5
    )
