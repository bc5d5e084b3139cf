"""What the docs tell users to type, checked against the real command-line parsers without running anything.

README.md, docs/*.md, the Makefile's recipes and deploy/ (compose services, Kubernetes containers) name commands of
this project: console scripts, ``python -m`` modules, ``torchrun ... training/pretrain.py`` and ``make`` targets.
Each is parsed by the parser its entry point builds. The entry points build their parsers inside ``main()``; rather
than restructure two dozen of them, :func:`parse_only` calls ``main()`` with argparse's parse step patched to stop
right after parsing, so the parser checked is exactly the one the command builds (subcommands and parent parsers
included) and nothing past it runs. After parsing, ``--set`` overrides go through the training (or decoder) config
loader, which rejects unknown keys and contradictions, and msn-serve's flags through its settings model.

Placeholders the docs write for values (``DIR``, ``HOST:29500``, ``$SLURM_NNODES``, ``<name>``) are accepted wherever
a value goes. ``...`` marks elided text: it may stand for a value, and a command with one (like an inline code span,
which is often a fragment of a command) may lack required arguments; everything it does say is still checked.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import re
import runpy
import shlex
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

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


# --- parsing without running ------------------------------------------------------------------------------------


class _Parsed(BaseException):  # BaseException: an entry point's `except Exception` must not swallow it
    def __init__(self, namespace: argparse.Namespace, extras: list[str]) -> None:
        self.namespace, self.extras = namespace, extras


class _ParseError(BaseException):
    pass


class _Exited(BaseException):
    def __init__(self, status: int) -> None:
        self.status = status


@dataclass
class Parse:
    """What a parse gave: the top-level namespace (None if it failed), problems, and required arguments missing."""

    namespace: argparse.Namespace | None
    problems: list[str]
    missing: list[str]


@contextlib.contextmanager
def _parse_only(lenient_required: bool) -> Iterator[list[str]]:
    """Within: the outermost parse raises :class:`_Parsed` when done; errors raise :class:`_ParseError` (required
    arguments missing are collected instead when ``lenient_required``, and parsing goes on); placeholders pass
    type conversion and ``choices`` (not sub-command names)."""
    cls = argparse.ArgumentParser
    saved = {name: getattr(cls, name) for name in ("parse_known_args", "error", "exit", "_get_value", "_check_value")}
    missing: list[str] = []
    depth = 0

    def parse_known_args(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        nonlocal depth
        depth += 1
        try:
            result = saved["parse_known_args"](self, args, namespace)
        finally:
            depth -= 1
        if depth == 0:
            raise _Parsed(*result)
        return result

    def error(self: argparse.ArgumentParser, message: str) -> None:
        if lenient_required and any(text in message for text in REQUIRED_ERRORS):
            missing.append(f"{self.prog}: {message}")
            return  # argparse goes on to return what it parsed
        raise _ParseError(f"{self.prog}: {message}")

    def exit_(self: argparse.ArgumentParser, status: int = 0, message: str | None = None) -> None:
        raise _Exited(status)

    def get_value(self: argparse.ArgumentParser, action: argparse.Action, arg_string: str) -> Any:
        return arg_string if is_placeholder(arg_string) else saved["_get_value"](self, action, arg_string)

    def check_value(self: argparse.ArgumentParser, action: argparse.Action, value: Any) -> None:
        if isinstance(value, str) and is_placeholder(value) and not isinstance(action, argparse._SubParsersAction):
            return
        saved["_check_value"](self, action, value)

    patched = {"parse_known_args": parse_known_args, "error": error, "exit": exit_, "_get_value": get_value,
               "_check_value": check_value}
    try:
        for name, function in patched.items():
            setattr(cls, name, function)
        yield missing
    finally:
        for name, function in saved.items():
            setattr(cls, name, function)


def parse_only(run: Callable[[], Any], argv: list[str], lenient_required: bool) -> Parse:
    """Run an entry point (``run``, with ``sys.argv`` = ``argv``) up to the end of its argument parsing."""
    saved_argv = sys.argv
    sys.argv = list(argv)
    try:
        with _parse_only(lenient_required) as missing, contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            run()
    except _Parsed as parsed:
        unknown = [word for word in parsed.extras if word != ELIDED]
        problems = [f"unrecognized arguments: {' '.join(unknown)}"] if unknown else []
        return Parse(parsed.namespace, problems, missing)
    except _ParseError as e:
        return Parse(None, [str(e)], missing)
    except _Exited as e:
        return Parse(None, [] if e.status == 0 else [f"exited with status {e.status}"], missing)
    except argparse.ArgumentError as e:
        return Parse(None, [str(e)], missing)
    finally:
        sys.argv = saved_argv
    return Parse(None, ["the entry point returned without parsing its arguments"], [])


def _module_runner(name: str) -> tuple[Callable[[], Any] | None, str | None]:
    """How ``python -m name`` starts: a package's ``__main__``, or a module's ``main()`` under its main guard."""
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        return None, f"python -m {name}: cannot import it ({e})"
    if hasattr(module, "__path__"):
        if importlib.util.find_spec(f"{name}.__main__") is None:
            return None, f"python -m {name}: the package has no __main__"
        return lambda: runpy.run_module(name, run_name="__main__", alter_sys=False), None
    source = Path(module.__file__).read_text(encoding="utf-8")
    if not re.search(r"""(?m)^if __name__ == ["']__main__["']:""", source):
        return None, f"python -m {name}: the module has no `if __name__ == \"__main__\"` block"
    main = getattr(module, "main", None)
    if callable(main):
        return main, None
    return lambda: runpy.run_module(name, run_name="__main__", alter_sys=False), None


def _script_runner(spec: str) -> Callable[[], Any]:
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)


# --- what is checked after parsing --------------------------------------------------------------------------------


def _plain(values: list[str]) -> list[str]:
    return [v for v in values if not is_placeholder(v) and not is_placeholder(v.partition("=")[2])]


def _repo_path(path: str | Path | None) -> Path | None:
    """A config path as the docs' commands give it, run from the repository root; None for a placeholder."""
    if path is None or _names_placeholder(str(path)):
        return None
    return ROOT / path


def _check_pretrain(ns: argparse.Namespace) -> list[str]:
    """The run's config as training/pretrain.py resolves it: ``--set`` keys, values and length conflicts. The images
    are not read: ``--data`` (or an elided ``--config``) stands for a folder, and the plan a config-less ``--data``
    run makes from its images is left out (``--set`` overrides are checked against the defaults there)."""
    from msn_core.sources import MEMORY_SOURCES
    from training.config import ConfigError
    from training.pretrain import resolve_config

    elided_config = ns.config is not None and _repo_path(ns.config) is None
    ns.config = _repo_path(ns.config)
    if ns.data in MEMORY_SOURCES:
        data = [f"data.source={ns.data}"]
    else:
        data = ["data.source=auto", f"data.root={json.dumps(str(ROOT))}"] if ns.data or elided_config else []
    ns.data = None
    ns.overrides = data + _plain(ns.overrides or [])
    for name in ("eval_data", "init_from"):
        if getattr(ns, name, None) is not None and _names_placeholder(getattr(ns, name)):
            setattr(ns, name, None)
    if isinstance(ns.budget, str):  # a placeholder passed through
        ns.budget = None
    try:
        resolve_config(ns)
    except (ConfigError, FileNotFoundError) as e:
        return [f"config: {e}"]
    return []


def _check_visualize(ns: argparse.Namespace) -> list[str]:
    """``msn-visualize train``: the decoder config with ``--data``/``--data-root``/``--set`` as the command builds
    them (a path given stands for a folder; it is not read)."""
    if ns.command != "train":
        return []
    from msn_core.sources import SOURCES
    from visualizer.config import ConfigError, load_config

    folder = f"data.root={json.dumps(str(ROOT))}"
    data = [f"data.source={ns.data}"] if ns.data in SOURCES else ["data.source=auto", folder] if ns.data else []
    data += [folder] if ns.data_root else []
    try:
        load_config(_repo_path(ns.config), data + _plain(list(ns.overrides or [])))
    except (ConfigError, FileNotFoundError) as e:
        return [f"decoder config: {e}"]
    return []


def _check_serve(ns: argparse.Namespace) -> list[str]:
    """msn-serve builds its settings from the flags before anything else: contradictions are errors there."""
    from pydantic import ValidationError

    from msn_serve.config import Settings

    values = vars(ns)
    if any(is_placeholder(str(v)) for v in values.values() if not isinstance(v, list)) or any(
            is_placeholder(item) for v in values.values() if isinstance(v, list) for item in v):
        return []
    try:
        Settings(**values)
    except ValidationError as e:
        return [f"settings: {e.errors()[0]['msg']}"]
    return []


AFTER_PARSE: dict[str, Callable[[argparse.Namespace], list[str]]] = {
    "training.pretrain": _check_pretrain,
    "visualizer.cli": _check_visualize,
    "msn_serve.cli": _check_serve,
    "msn_serve": _check_serve,
}


# --- checking one command -----------------------------------------------------------------------------------------


def check(command: Command) -> Report:
    """Parse ``command`` with the parser of the entry point it names; see the module docstring."""
    prog, args = Path(command.argv[0]).name, list(command.argv[1:])
    report = Report()
    if prog == "make":
        problems = _check_make(args)
    elif prog == "torchrun":
        return _check_torchrun(command, args)
    elif prog in console_scripts():
        spec = console_scripts()[prog]
        problems = _check_entry(prog, _script_runner(spec), spec.partition(":")[0], args, command.fragment)
    else:
        module, rest = _python_target(args) or ("", [])
        runner, why = _module_runner(module)
        problems = [why] if runner is None else _check_entry(module, runner, module, rest, command.fragment)
    report.problems = [f"{command}\n    {p}" for p in problems]
    report.checked = 1
    report.fragments = int(command.fragment)
    return report


def _check_entry(prog: str, run: Callable[[], Any], module: str, args: list[str], fragment: bool) -> list[str]:
    parsed = parse_only(run, [prog, *args], lenient_required=fragment)
    problems = list(parsed.problems)
    if parsed.namespace is not None and not problems and module in AFTER_PARSE:
        problems += AFTER_PARSE[module](parsed.namespace)
    return problems


def _check_torchrun(command: Command, args: list[str]) -> Report:
    """torchrun's own flags by torch's parser, then the script or module it starts by that one's parser."""
    from torch.distributed.run import get_args_parser

    report = Report(checked=1, fragments=int(command.fragment))
    starts = [i for i, a in enumerate(args) if a.endswith(".py") or a in ("-m", "--module")]
    if not starts:  # `torchrun --nproc_per_node=2` in prose, `torchrun --max-restarts=3 ...`: torchrun's flags only
        given = args[:args.index(ELIDED)] if ELIDED in args else args
        if not given:
            report.checked = report.fragments = 0
            report.skipped.append(str(command))
            return report
        parsed = parse_only(lambda: get_args_parser().parse_args([*given, "SCRIPT.py"]), ["torchrun"],
                            lenient_required=True)
        report.problems = [f"{command}\n    {p}" for p in parsed.problems]
        return report
    own = [a for a in args[:starts[0]] if a != ELIDED] + args[starts[0]:]
    parsed = parse_only(lambda: get_args_parser().parse_args(own), ["torchrun", *own],
                        lenient_required=command.fragment)
    problems = list(parsed.problems)
    if parsed.namespace is not None and not problems:
        ns = parsed.namespace
        module = ns.training_script if ns.module else str(Path(ns.training_script).with_suffix("")).replace("/", ".")
        if not ns.module and not (ROOT / ns.training_script).is_file():
            problems.append(f"torchrun: no script {ns.training_script}")
        else:
            runner, why = _module_runner(module)
            problems += [why] if runner is None else _check_entry(
                module, runner, module, list(ns.training_script_args), command.fragment)
    report.problems = [f"{command}\n    {p}" for p in problems]
    return report


def _check_make(args: list[str]) -> list[str]:
    text = (ROOT / "Makefile").read_text()
    targets, variables = makefile_targets(text), makefile_variables(text)
    problems = []
    for arg in args:
        name = arg.partition("=")[0]
        if "=" in arg and name not in variables:
            problems.append(f"make: {name} is not a Makefile variable")
        elif "=" not in arg and not arg.startswith("-") and arg not in targets and arg != ELIDED:
            problems.append(f"make: no target {arg!r} (targets: {', '.join(sorted(targets))})")
    return problems


def check_all(commands: list[Command]) -> Report:
    report = Report()
    for command in commands:
        report.add(check(command))
    return report


# --- the project's documents --------------------------------------------------------------------------------------


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_commands() -> tuple[list[Command], list[str]]:
    """Every project command in README.md, docs/*.md and the Makefile's recipes."""
    commands, problems = [], []
    for doc in documents():
        found, bad = markdown_commands(doc.read_text(encoding="utf-8"), str(doc.relative_to(ROOT)))
        commands += found
        problems += bad
    found, bad = makefile_commands((ROOT / "Makefile").read_text())
    return commands + found, problems + bad


# --- links --------------------------------------------------------------------------------------------------------


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, lower case, punctuation dropped except ``-`` and
    ``_``, spaces made ``-`` (no collapsing)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _without_code(text: str) -> list[str]:
    """The lines of a markdown text with code blocks blanked and inline code removed (links there are not links)."""
    lines, fence = [], ""
    for line in text.splitlines():
        opening = re.match(r"\s*(`{3,}|~{3,})", line)
        if not fence and opening:
            fence = opening.group(1)
            lines.append("")
        elif fence:
            fence = "" if line.strip().startswith(fence) else fence
            lines.append("")
        else:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def anchors(doc: Path) -> set[str]:
    """The anchors of a markdown file's headings, with GitHub's ``-1``, ``-2`` suffixes for repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    fence = ""
    for line in doc.read_text(encoding="utf-8").splitlines():
        opening = re.match(r"\s*(`{3,}|~{3,})", line)
        if opening and (not fence or line.strip().startswith(fence)):
            fence = "" if fence else opening.group(1)
            continue
        heading = None if fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = github_slug(heading.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def check_links(doc: Path, text: str | None = None) -> tuple[int, list[str]]:
    """Relative links and ``#anchors`` of one markdown file: the target exists and has the heading. Returns the
    number of links checked and the broken ones."""
    text = doc.read_text(encoding="utf-8") if text is None else text
    checked, problems = 0, []
    for number, line in enumerate(_without_code(text), 1):
        for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line):
            target = m.group(1)
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
                continue
            checked += 1
            path, _, anchor = target.partition("#")
            resolved = doc if not path else (doc.parent / _unquote(path)).resolve()
            where = f"{doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc.name}:{number}"
            if not resolved.exists():
                problems.append(f"{where}: link to missing {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{where}: no heading #{anchor} in {resolved.name}")
    return checked, problems


def _unquote(path: str) -> str:
    from urllib.parse import unquote

    return unquote(path)


# --- deploy/ ------------------------------------------------------------------------------------------------------


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR-default}`` with the default (the variables are unset here)."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", r"\1", value)


def dockerfile_stage_argv(target: str) -> tuple[list[str], list[str]]:
    """ENTRYPOINT and CMD (exec form) a Dockerfile build target ends with, following ``FROM <stage>`` chains."""
    import json

    stages: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if m := re.match(r"(?i)FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line):
            current = {"base": m.group(1), "entrypoint": None, "cmd": None}
            stages[m.group(2) or f"#{len(stages)}"] = current
        elif m := re.match(r"(?i)(ENTRYPOINT|CMD)\s+(\[.*\])\s*$", line):
            current[m.group(1).lower()] = json.loads(m.group(2))
    stage = stages[target]
    entrypoint, cmd = stage["entrypoint"], stage["cmd"]
    while (entrypoint is None or cmd is None) and stage["base"] in stages:
        stage = stages[stage["base"]]
        entrypoint = stage["entrypoint"] if entrypoint is None else entrypoint
        cmd = stage["cmd"] if cmd is None else cmd
    return entrypoint or [], cmd or []


def compose_commands(compose: dict[str, Any], name: str = "deploy/compose.yaml") -> list[Command]:
    """What each compose service built from this repository's Dockerfile runs: its entrypoint and command, the
    image's where the service gives none (Docker's rule: a service ``entrypoint`` drops the image's CMD)."""
    commands = []
    for service, spec in compose["services"].items():
        if "build" not in spec:
            continue  # a third-party image (prometheus): not our parser
        image_entrypoint, image_cmd = dockerfile_stage_argv(spec["build"]["target"])
        entrypoint = spec.get("entrypoint", image_entrypoint)
        command = spec.get("command", image_cmd if "entrypoint" not in spec else [])
        argv = [interpolate(str(word)) for word in [*_as_list(entrypoint), *_as_list(command)]]
        if is_project_command(argv):
            commands.append(Command(f"{name}: services.{service}", tuple(argv)))
    return commands


def kubernetes_commands() -> list[Command]:
    """Containers of deploy/k8s with an explicit command: ``command`` + ``args``."""
    import yaml

    commands = []
    for path in sorted((ROOT / "deploy" / "k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for container in _containers(doc):
                argv = [*_as_list(container.get("command", [])), *_as_list(container.get("args", []))]
                if is_project_command(argv):
                    where = f"{path.relative_to(ROOT)}: container {container.get('name')}"
                    commands.append(Command(where, tuple(str(a) for a in argv)))
    return commands


def _containers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)


def _as_list(value: Any) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value or []]

