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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.doc_command_lines import (
    ELIDED,
    REQUIRED_ERRORS,
    ROOT,
    Command,
    Report,
    _names_placeholder,
    _python_target,
    console_scripts,
    is_placeholder,
    is_project_command,
    makefile_commands,
    makefile_targets,
    makefile_variables,
    markdown_commands,
)
from tests.doc_links import check_links

__all__ = ["ROOT", "Command", "Report", "check_all", "check_links", "compose_commands", "documented_commands",
           "documents", "interpolate", "kubernetes_commands", "markdown_commands"]


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

