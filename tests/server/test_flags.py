"""Flags made from the config fields (server/flags.py): defaults, names, choices and the way back to argv."""
from dataclasses import replace

import pytest

from engine.config import EngineConfig
from server.cli import engine_config, serve_config
from server.config import API_KEY_ENV, ServerConfig
from server.flags import config_as_argv
from specserve import build_parser


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_without_flags_every_config_holds_its_defaults():
    assert serve_config(parse()).engine == EngineConfig()
    assert serve_config(parse()).server == ServerConfig()


def test_flag_names_defaults_and_choices_come_from_the_fields():
    config = serve_config(parse("--kv-cache-memory", "0.5", "--no-goodput-planner", "--session-mode", "off",
                                "--engine-stall-timeout", "7", "--drafter", "ngram", "--trust-remote-code"))
    assert config.engine.cache.kv_cache_memory_gib == 0.5 and not config.engine.scheduler.use_goodput_planner
    assert config.engine.sessions.mode == "off" and config.server.engine_stall_timeout_s == 7.0
    assert config.engine.spec.drafter == "ngram" and config.engine.model.trust_remote_code
    for bad in (["--drafter", "nope"], ["--session-mode", "sometimes"], ["--weights", "int3"]):
        with pytest.raises(SystemExit):
            parse(*bad)


def test_fields_without_help_are_not_flags():
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert (
        "--seed" not in help_text and "--acceptance-prior" not in help_text and "--max-request-bytes" not in help_text
    )


def test_a_config_turned_into_flags_parses_back_to_itself():
    base = EngineConfig()
    config = replace(
        base.with_drafter("copyspec+draft", copy_gamma=5, pld_plus_layer=3),
        model=replace(base.model, draft_model="early-exit:20", num_threads=2, weights="int4"),
        scheduler=replace(base.scheduler, use_goodput_planner=False, max_num_seqs=8),
        sessions=replace(base.sessions, ttl_s=30.0),
    )
    argv = config_as_argv(config)
    assert engine_config(parse(*argv)) == config
    assert "--drafter" not in config_as_argv(config, skip=("drafter",)) and config_as_argv(EngineConfig()) == []


def test_the_api_key_defaults_to_its_environment_variable(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    assert serve_config(parse()).server.api_key == "sk-from-env"
    assert serve_config(parse("--api-key", "sk-flag")).server.api_key == "sk-flag"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert serve_config(parse()).server.api_key is None  # set but empty: no key, not a key anyone matches
