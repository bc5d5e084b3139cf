"""Schema-driven fuzzing: schemathesis generates requests for every operation of the server's own OpenAPI document
(generated from the request models) and sends them to a real server, with and without the API key.

The assertion is the issue's: no response is a 5xx, and the server is alive and serving at the end. Examples per
operation are bounded (and derandomised, so a failure reproduces) to keep this suite to a minute or two.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from serve_helpers import Server, encode, random_image

KEY = "fuzz-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPEN = {"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"}
FUZZ = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_server(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "key").write_text(KEY)
    srv = Server(bundle_dir, root / "data", "--api-key-file", str(root / "key"), "--max-body-mb", "4",
                 "--fit-timeout-s", "30").start()
    with srv.client(headers=AUTH) as c:  # something to find: an index, a classifier
        vecs = [[float((i * 7 + j) % 5) for j in range(64)] for i in range(4)]
        assert c.post("/index/fuzz/add", json={"ids": [1, 2, 3, 4], "vectors": vecs}).status_code == 200
        assert c.post("/fewshot/fit", json={"name": "fuzz", "labels": ["a", "b", "a", "b"],
                                            "embeddings": vecs}).status_code == 201
        assert c.post("/embed", files={"image": encode(random_image(0))}).status_code == 200
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server: Server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", headers=AUTH)


def _runner(op, server: Server, mode: GenerationMode, examples: int, headers: dict[str, str], problems: list[str]):
    """A hypothesis test sending ``examples`` generated cases of ``op``; what goes wrong lands in ``problems``."""
    @given(case=op.as_strategy(generation_mode=mode))
    @settings(FUZZ, max_examples=examples)
    def run(case) -> None:
        response = case.call(base_url=server.url, headers=headers, timeout=120)
        if response.status_code >= 500:
            problems.append(f"{op.label} -> {response.status_code}: {response.text[:300]}\n"
                            f"  {case.as_curl_command(headers=headers)}")
        elif not headers and case.path not in OPEN and response.status_code != 401:
            problems.append(f"{op.label} answered {response.status_code} without the key")

    return run


def _fuzz(api_schema, server: Server, mode: GenerationMode, examples: int, headers: dict[str, str]) -> list[str]:
    """Every operation of the schema in turn; returns what went wrong (5xx, a wrong answer without the key)."""
    problems: list[str] = []
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 20, [op.label for op in operations]
    for op in operations:
        try:
            _runner(op, server, mode, examples, headers, problems)()
        except Unsatisfiable:  # nothing to make invalid (no parameters, no body): the valid run covers it
            assert mode is GenerationMode.NEGATIVE, op.label
    return problems


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_no_5xx_with_the_key(api_schema, fuzz_server: Server, mode: GenerationMode):
    problems = _fuzz(api_schema, fuzz_server, mode, 10, AUTH)
    assert not problems, "\n".join(problems[:20])


def test_no_5xx_and_401_without_the_key(api_schema, fuzz_server: Server):
    problems = _fuzz(api_schema, fuzz_server, GenerationMode.POSITIVE, 3, {})
    assert not problems, "\n".join(problems[:20])


def test_the_server_survived_the_fuzzing(fuzz_server: Server):
    assert fuzz_server.alive()
    with fuzz_server.client(headers=AUTH) as c:
        assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200
        assert c.post("/embed", files={"image": encode(random_image(1))}).status_code == 200
        metrics = c.get("/metrics").text
    server_errors = [ln for ln in metrics.splitlines() if 'status="5' in ln and 'route="/readyz"' not in ln
                     and 'route="/v2/health/ready"' not in ln]
    assert not server_errors, server_errors
