"""Builds the configured drafter by name; `none` means plain decoding."""
from __future__ import annotations

from typing import Callable

from drafters.base import Drafter
from drafters.config import SpecConfig
from drafters.copyspec import CopySpecDrafter

_BUILDERS: dict[str, Callable[[SpecConfig], Drafter]] = {
    "copyspec": lambda config: CopySpecDrafter(config.copy_gamma, config.copy_max_tokens),
}

DRAFTER_NAMES = ("none", *_BUILDERS)


def build_drafter(config: SpecConfig) -> Drafter | None:
    if config.drafter == "none":
        return None
    try:
        return _BUILDERS[config.drafter](config)
    except KeyError:
        raise ValueError(f"unknown drafter {config.drafter!r}; choose one of {DRAFTER_NAMES}") from None
