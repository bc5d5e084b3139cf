"""The command lines the docs tell users to type, found: fenced shell blocks and inline code spans of README.md and
docs/*.md, and the Makefile's recipes, split into one :class:`Command` per project entry point (console scripts,
``python -m`` modules of the project, ``torchrun ... training/pretrain.py`` and ``make``). Checking them against the
real parsers is :mod:`tests.doc_commands`.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ELIDED = "..."
PROJECT_PACKAGES = ("msn_core", "training", "msn_serve", "visualizer", "benchmarks", "tests")
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "text", "make"}
SEPARATORS = {"|", "||", "&&", ";", "&"}
LEADING_KEYWORDS = {"do", "then", "else", "{", "(", "!", "time", "nohup", "exec", "sudo", "env"}
REQUIRED_ERRORS = ("the following arguments are required", "is required")


@dataclass(frozen=True)
class Command:
    """One command line a user is told to type. ``fragment``: an inline span or an elided line, which may leave out
    required arguments (the ones it gives are checked all the same)."""

    where: str
    argv: tuple[str, ...]
    fragment: bool = False

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


@dataclass
class Report:
    """What a check saw: problems, and how many commands were checked whole, as fragments, or not at all."""

    problems: list[str] = field(default_factory=list)
    checked: int = 0
    fragments: int = 0
    skipped: list[str] = field(default_factory=list)

    def add(self, other: Report) -> None:
        self.problems += other.problems
        self.checked += other.checked
        self.fragments += other.fragments
        self.skipped += other.skipped


def is_placeholder(token: str) -> bool:
    """A value the reader fills in: ``DIR``, ``HOST:29500``, ``B2``, ``$VAR``, ``<name>``, or ``...``."""
    if token == ELIDED or "$" in token or re.search(r"<[^<>]+>", token):
        return True
    return re.search(r"[A-Z]", token) is not None and re.search(r"[a-z]", token) is None


def _names_placeholder(path: str) -> bool:
    return any(is_placeholder(part) or is_placeholder(Path(part).stem) for part in Path(path).parts)


# --- finding commands ---------------------------------------------------------------------------------------------


def _tokens(text: str) -> list[str]:
    """Shell words with comments stripped, ``[--optional flags]`` unbracketed and elisions made ``...``."""
    words, out, optional = shlex.split(text, comments=True), [], 0
    for word in words:
        if word.startswith("[-"):
            word, optional = word[1:], optional + 1
        if optional and word.endswith("]"):
            word, optional = word[:-1], optional - 1
        if word.startswith("...") or word.endswith("..."):
            word = ELIDED
        out.append(word)
    return out


def _segments(words: list[str]) -> Iterator[list[str]]:
    """Split a line's words into simple commands at pipes, ``&&``, ``||``, ``;`` and ``&``; drop redirections."""
    segment: list[str] = []
    skip_next = False
    for word in words:
        if skip_next:
            skip_next = False
            continue
        if word in SEPARATORS:
            yield segment
            segment = []
        elif word in {">", ">>", "<", "2>", "2>>", "&>"}:
            skip_next = True
        elif re.fullmatch(r"\d*(>>?|<|&>)&?\S+", word):
            continue
        elif word.endswith(";") and word != ";":
            segment.append(word[:-1])
            yield segment
            segment = []
        else:
            segment.append(word)
    yield segment


def _program(words: list[str]) -> list[str]:
    """The words from the program on: leading ``VAR=value`` assignments and wrappers (``taskset -c 1``) dropped."""
    i = 0
    while i < len(words):
        word = words[i]
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word) or word in LEADING_KEYWORDS:
            i += 1
        elif word == "taskset":
            i += 3 if i + 1 < len(words) and words[i + 1].startswith("-") else 2
        elif word == "timeout":
            i += 2
        else:
            break
    return words[i:]


@cache
def console_scripts() -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: name -> ``module:function``."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def is_project_command(words: list[str]) -> bool:
    if not words:
        return False
    prog = Path(words[0]).name
    if prog in console_scripts() or prog in ("torchrun", "make"):
        return True
    if re.fullmatch(r"python(3(\.\d+)?)?", prog):
        target = _python_target(words[1:])
        return target is not None and target[0].split(".")[0] in PROJECT_PACKAGES
    return False


def _python_target(args: list[str]) -> tuple[str, list[str]] | None:
    """The module ``python -m M ARGS`` or ``python path/to/script.py ARGS`` runs (a dotted name) and its ARGS."""
    for i, arg in enumerate(args):
        if arg == "-m":
            return (args[i + 1], args[i + 2:]) if i + 1 < len(args) else None
        if arg.endswith(".py"):
            return str(Path(arg).with_suffix("")).replace("/", "."), args[i + 1:]
        if not arg.startswith("-"):
            return None
    return None


def commands_in_line(text: str, where: str, fragment: bool) -> tuple[list[Command], list[str]]:
    """The project commands in one shell line; a line that cannot be split is returned as a problem."""
    if not re.search(r"msn-|python|torchrun|make", text):
        return [], []
    try:
        words = _tokens(text)
    except ValueError as e:  # unbalanced quotes: a problem only where the line runs one of ours
        return [], [f"{where}: cannot split {text!r}: {e}"] if is_project_command(_program(text.split())) else []
    found = []
    for segment in _segments(words):
        argv = _program(segment)
        if is_project_command(argv) and not (fragment and len(argv) == 1):  # a bare name in prose is a mention
            if fragment and argv[-1].startswith("-") and "=" not in argv[-1]:
                argv.append(ELIDED)  # `msn-visualize sample --guidance-scale` names an option; its value is left out
            found.append(Command(where, tuple(argv), fragment or ELIDED in argv))
    return found, []


def _shell_lines(block: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Logical lines of a code block: ``\\`` continuations joined, numbered by their first line."""
    start, parts = None, []
    for number, line in block:
        start = number if start is None else start
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        yield start, " ".join(parts)
        start, parts = None, []
    if parts:
        yield start, " ".join(parts)


def markdown_commands(text: str, name: str) -> tuple[list[Command], list[str]]:
    """Commands in a markdown text: every line of shell code blocks, and inline code spans that are commands."""
    commands, problems = [], []
    prose: list[str] = []
    block: list[tuple[int, str]] | None = None
    fence, language = "", ""
    for number, line in enumerate(text.splitlines(), 1):
        opening = re.match(r"\s*(`{3,}|~{3,})\s*([\w+-]*)", line)
        if block is None and opening:
            fence, language, block = opening.group(1), opening.group(2).lower(), []
            prose.append("")
        elif block is not None and line.strip().startswith(fence):
            if language in SHELL_FENCES:
                for start, logical in _shell_lines(block):
                    found, bad = commands_in_line(logical, f"{name}:{start}", fragment=False)
                    commands += found
                    problems += bad
            block = None
            prose.append("")
        elif block is not None:
            block.append((number, line))
            prose.append("")
        else:
            prose.append(line)
    for span, number in inline_code_spans("\n".join(prose)):
        found, bad = commands_in_line(span, f"{name}:{number}", fragment=True)
        commands += found
        problems += bad
    return commands, problems


def inline_code_spans(text: str) -> Iterator[tuple[str, int]]:
    """``code`` spans of markdown prose (single backticks; a span may wrap onto the next line of its paragraph),
    with the line each starts on."""
    offset = 0
    for paragraph in re.split(r"(\n\s*\n)", text):
        for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", paragraph):
            line = text.count("\n", 0, offset + match.start()) + 1
            yield match.group(1).replace("\n", " "), line
        offset += len(paragraph)


def makefile_commands(text: str, name: str = "Makefile") -> tuple[list[Command], list[str]]:
    """Commands in the Makefile's recipes, with its variables expanded to their defaults."""
    variables = makefile_variables(text)
    commands, problems = [], []
    lines = [(n, line[1:]) for n, line in enumerate(text.splitlines(), 1) if line.startswith("\t")]
    for start, logical in _shell_lines(lines):
        logical = expand_make(logical.lstrip("@-"), variables).replace("$$", "$")
        found, bad = commands_in_line(logical, f"{name}:{start}", fragment=False)
        commands += found
        problems += bad
    return commands, problems


def makefile_variables(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r"(?m)^([A-Za-z_][A-Za-z0-9_]*)\s*[?:+]?=(.*)$", text)}


def makefile_targets(text: str) -> set[str]:
    targets = set()
    for m in re.finditer(r"(?m)^([^\s:=#][^:=#]*?)\s*:(?!=)", text):
        targets.update(t for t in m.group(1).split() if "$" not in t and not t.startswith("."))
    return targets


def expand_make(text: str, variables: dict[str, str]) -> str:
    for _ in range(10):
        expanded = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                          lambda m: variables.get(m.group(1), m.group(0)), text)
        if expanded == text:
            break
        text = expanded
    return text
