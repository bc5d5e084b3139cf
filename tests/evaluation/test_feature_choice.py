"""The served feature is chosen for what training added, not only for its score (feature_choice.choose)."""
from __future__ import annotations

from benchmarks.evaluation.feature_choice import MARGIN, choose


def _row(score: float, shots: tuple[float, float, float], untrained: tuple[float, float, float] | None) -> dict:
    row = {"score": score, **{f"{s}shot": {"mean": m} for s, m in zip((1, 2, 5), shots)}}
    if untrained is not None:
        row["untrained"] = {f"{s}shot": {"mean": m} for s, m in zip((1, 2, 5), untrained)}
    return row


def test_a_higher_scoring_feature_a_random_network_already_gives_loses_to_a_learned_one() -> None:
    rows = {"pixels": {"score": 60.0},
            "map": _row(66.0, (50, 57, 66), (47, 53, 63)),  # +3 / +4 / +3 over the twin: the architecture's
            "cls": _row(63.0, (52, 58, 67), (33, 34, 41))}
    chosen, reason = choose(rows, ["map", "cls"])
    assert chosen == "cls", reason
    assert "cls" in reason and "map" not in reason.split("(")[-1]


def test_without_a_qualifier_the_best_worse_margin_wins_and_the_reason_says_none_qualified() -> None:
    rows = {"pixels": {"score": 64.0},
            "map": _row(65.0, (50, 57, 66), (47, 53, 63)),  # +1 over pixels, +3 over the twin
            "cls": _row(62.0, (49, 52, 62), (33, 34, 41))}  # -2 over pixels, +16 over the twin
    chosen, reason = choose(rows, ["map", "cls"])
    assert chosen == "map"
    assert reason.startswith("no feature") and f"{MARGIN:g}" in reason


def test_rows_without_the_control_fall_back_to_the_best_score() -> None:
    rows = {"pixels": {"score": 64.0}, "a": _row(61.0, (1, 2, 3), None), "b": _row(62.0, (1, 2, 3), None)}
    assert choose(rows, ["a", "b"])[0] == "b"
