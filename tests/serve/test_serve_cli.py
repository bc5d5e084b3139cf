"""msn-serve's flags reach the settings the service runs with, and the MSN_SERVE_* variables still work beside them.

The label loop's limits (docs/serving.md, "Limits and security") were environment variables only while the docs
showed them as flags; these checks hold both ways of setting them to the same settings object.
"""

from __future__ import annotations

import pytest

from msn_serve.cli import parse_args
from msn_serve.config import Settings

LABEL_LOOP_LIMITS = {"select_candidates": 50, "max_select": 30, "max_page": 25}


def settings_from(argv: list[str]) -> Settings:
    """What ``msn-serve ARGV`` builds before it starts (msn_serve.cli.main's first step)."""
    return Settings(**parse_args(argv))


def test_label_loop_limit_flags_reach_the_settings() -> None:
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in LABEL_LOOP_LIMITS.items()]
    settings = settings_from(argv)
    assert {name: getattr(settings, name) for name in LABEL_LOOP_LIMITS} == LABEL_LOOP_LIMITS


def test_label_loop_limits_from_the_environment_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in LABEL_LOOP_LIMITS.items():
        monkeypatch.setenv(f"MSN_SERVE_{name.upper()}", str(value))
    assert {name: getattr(settings_from([]), name) for name in LABEL_LOOP_LIMITS} == LABEL_LOOP_LIMITS
    assert settings_from(["--max-select", "7"]).max_select == 7  # the flag overrides the variable
    assert settings_from(["--max-select", "7"]).max_page == LABEL_LOOP_LIMITS["max_page"]


def test_a_bad_limit_flag_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--max-page", "many"])
    with pytest.raises(ValueError, match="max_select"):
        settings_from(["--max-select", "0"])  # ge=1, as for the variable
