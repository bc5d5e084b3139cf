"""Every command the docs tell users to type parses with the real parser, and every relative link resolves.

The commands come from README.md, docs/*.md, the Makefile's recipes, deploy/compose.yaml and deploy/k8s; they are
parsed, never run (tests/doc_commands.py says how). The planted-error test shows the checker catches what it claims.
"""

from __future__ import annotations

import re

import pytest
import yaml

from tests.doc_commands import (
    ROOT,
    Command,
    Report,
    check_all,
    check_links,
    compose_commands,
    documented_commands,
    documents,
    interpolate,
    kubernetes_commands,
    markdown_commands,
)

COMPOSE = ROOT / "deploy" / "compose.yaml"


@pytest.fixture(scope="module")
def documented() -> tuple[list[Command], Report]:
    commands, problems = documented_commands()
    report = check_all(commands)
    report.problems = problems + report.problems
    return commands, report


def test_every_documented_command_parses(documented: tuple[list[Command], Report]) -> None:
    commands, report = documented
    assert not report.problems, "\n".join(report.problems)
    # The checker must have found the docs' commands (a broken extractor would pass vacuously), and elided lines
    # it cannot check at all stay few.
    assert report.checked >= 150 and report.checked == len(commands) - len(report.skipped)
    assert len(report.skipped) <= 5, "\n".join(report.skipped)
    print(f"\n{report.checked} commands parsed ({report.fragments} inline or elided fragments), "
          f"{len(report.skipped)} skipped: {report.skipped}")


def test_deploy_commands_parse() -> None:
    commands = compose_commands(yaml.safe_load(COMPOSE.read_text())) + kubernetes_commands()
    wheres = {c.where for c in commands}
    assert {"deploy/compose.yaml: services.msn-serve", "deploy/compose.yaml: services.visualizer"} <= wheres
    assert any("pytorchjob" in w for w in wheres)
    report = check_all(commands)
    assert not report.problems, "\n".join(report.problems)


def test_compose_msn_serve_environment_is_settings() -> None:
    """The compose service configures msn-serve through MSN_SERVE_* variables: each must name a setting (pydantic-
    settings ignores unknown ones silently) and the values must validate together."""
    from msn_serve.config import Settings

    env = yaml.safe_load(COMPOSE.read_text())["services"]["msn-serve"]["environment"]
    values = {key.removeprefix("MSN_SERVE_").lower(): interpolate(str(v)) for key, v in env.items()}
    assert all(key.startswith("MSN_SERVE_") for key in env) and set(values) <= set(Settings.model_fields)
    assert Settings(**values).host == "0.0.0.0"


def test_every_relative_link_and_anchor_resolves() -> None:
    checked, problems = 0, []
    for doc in documents():
        n, bad = check_links(doc)
        checked, problems = checked + n, problems + bad
    assert not problems, "\n".join(problems)
    assert checked >= 50
    print(f"\n{checked} relative links checked")


PLANTED = """
# Planted

Run `msn-serve --no-such-flag` or `msn-eval knn --k many`; a fragment may leave out required flags: `msn-index build`.

```bash
msn-serve --port PORT --bundle DIR   # placeholders are fine
msn-index build                      # but a whole command may not
torchrun training/pretrain.py --config configs/fmnist_vit_tiny.yaml --output-dir runs/x --set optim.no_such_key=1
python -m training.pretrain --config configs/fmnist_vit_tiny.yaml --output-dir runs/x --set optim.total_steps=5
make no-such-target && make demo NO_SUCH_VARIABLE=1
msn-visualize sample ... --mask-ratio 0.5 --no-such-option
```

See [the app](visualizer.md#no-such-heading), [missing](no-such-file.md) and \
[fine](visualizer.md#the-app-visualizerapppy).
"""


def test_the_checker_reports_planted_errors() -> None:
    commands, problems = markdown_commands(PLANTED, "planted.md")
    report = check_all(commands)
    found = "\n".join(problems + report.problems)
    expected = [
        r"msn-serve --no-such-flag.*\n.*unrecognized arguments: --no-such-flag",
        r"msn-eval knn --k many\n.*invalid int value: 'many'",
        r"msn-index build\n.*required: --embeddings",
        r"optim.no_such_key=1\n.*config: .*no_such_key",
        r"optim.total_steps=5\n.*config: set optim.total_steps or optim.budget_minutes, not both",
        r"make: no target 'no-such-target'",
        r"make: NO_SUCH_VARIABLE is not a Makefile variable",
        r"--no-such-option\n.*unrecognized arguments: --no-such-option",
    ]
    for pattern in expected:
        assert re.search(pattern, found), f"not reported: {pattern}\n--- report:\n{found}"
    assert len(report.problems) == len(expected)  # one per planted error, nothing else
    assert "PORT" not in found and "planted.md:4: msn-index build" not in found  # placeholders, fragment

    checked, broken = check_links(ROOT / "docs" / "planted.md", PLANTED)
    assert checked == 3 and len(broken) == 2
    assert "no heading #no-such-heading in visualizer.md" in broken[0] and "no-such-file.md" in broken[1]


def test_every_documented_limit_is_a_flag() -> None:
    """docs/serving.md: "Every limit is a setting: a msn-serve flag or a MSN_SERVE_<NAME> environment variable"."""
    from msn_serve.cli import parse_args
    from msn_serve.config import Settings

    text = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    section = text.split("## Limits and security", 1)[1].split("\n## ", 1)[0]
    limits = re.findall(r"(?m)^\| `([a-z_]+)` \| [\d,.]+ \|", section)
    assert len(limits) >= 20
    for name in limits:
        default = Settings.model_fields[name].default
        value = default + 1 if isinstance(default, int) else default * 2
        settings = Settings(**parse_args([f"--{name.replace('_', '-')}", str(value)]))
        assert getattr(settings, name) == value, name


def test_docs_and_packaging_claim_python_311() -> None:
    """typing.Self and datetime.UTC need 3.11: the package metadata, ruff and the images say so."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'(?m)^requires-python = ">=3\.11"$', pyproject)
    assert re.search(r'(?m)^target-version = "py311"$', pyproject)
    assert re.search(r"(?m)^ARG PYTHON_IMAGE=python:3\.1[1-9]", (ROOT / "Dockerfile").read_text())
    for path in [*documents(), ROOT / "Dockerfile", ROOT / "pyproject.toml"]:
        assert not re.search(r"python ?3\.10\b|py310", path.read_text(encoding="utf-8"), re.IGNORECASE), path
