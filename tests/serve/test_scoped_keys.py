"""API keys with scopes (``msn_serve.http.auth``), against a real server: every route has a scope, read keys cannot
change anything (403 naming the scope), write keys can, admin routes need admin, a revoked key is refused after one
reload (the file's mtime poll, or SIGHUP), the one-key setting still opens everything, and no key reaches the log."""
from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import Server

from msn_serve.config import Settings
from msn_serve.http.app import create_app
from msn_serve.http.auth import OPEN, ROUTE_SCOPES, SCOPES, parse_keys_file

READ, WRITE, ADMIN, OTHER, SINGLE = "read-key-0123456789", "write-key-0123456789", "admin-key-0123456789", \
    "other-key-0123456789", "single-key-0123456789"
DIM = 64  # the test bundle's embedding width


def _sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _keys_text(read_key: str = READ) -> str:
    return (f"# scopes  key  name\nread {_sha(read_key)} dashboard\nread,write {_sha(WRITE)} ingest\n"
            f"admin {ADMIN}  # a raw key works too\n")


def _routes(routes: list, prefix: str = "") -> list[str]:
    """"METHOD /path" of every route, routers included with FastAPI's include_router walked into."""
    out = []
    for r in routes:
        if hasattr(r, "original_router"):  # FastAPI's included router (a branch, not a route)
            out += _routes(r.original_router.routes, prefix + r.include_context.prefix)
        else:
            out += [f"{m} {prefix}{r.path}" for m in sorted(getattr(r, "methods", None) or ())]
    return out


def test_every_route_has_a_scope(bundle_dir: Path, tmp_path: Path):
    app = create_app(Settings(bundle=bundle_dir, data_dir=tmp_path / "data", precision="fp32",
                              runtime="onnxruntime"))
    routes = _routes(app.routes)
    assert len(routes) > 30
    documented = [f"{m.upper()} {p}" for p, ops in app.openapi()["paths"].items() for m in ops]
    assert set(documented) <= set(routes)  # the walk below found every route the OpenAPI document lists
    unscoped = [r for r in routes if r not in ROUTE_SCOPES]
    assert not unscoped, f"routes without a scope in msn_serve.http.auth.ROUTE_SCOPES: {unscoped}"
    assert set(ROUTE_SCOPES.values()) == {OPEN, *SCOPES}


def test_keys_file_format_errors_name_the_line():
    assert [k.name for k in parse_keys_file(_keys_text(), "keys")] == ["dashboard", "ingest", "sha256:" +
                                                                        _sha(ADMIN)[7:15]]
    with pytest.raises(ValueError, match=r"keys:2: unknown scope\(s\) \['root'\]"):
        parse_keys_file(f"read {READ}\nroot {WRITE}\n", "keys")
    with pytest.raises(ValueError, match="keys:1: expected 'scopes key"):
        parse_keys_file("read\n", "keys")


def _mutating() -> list[tuple[str, str, str]]:
    """(method, concrete path, scope) of every route that needs more than read."""
    out = []
    for route, scope in ROUTE_SCOPES.items():
        if scope in ("write", "admin") and not route.startswith("GET"):
            method, template = route.split(" ", 1)
            out.append((method, template.replace("{name}", "t"), scope))
    return out


@pytest.mark.slow
def test_scoped_keys_against_a_real_server(bundle_dir: Path, tmp_path: Path):
    keys_file, single_file = tmp_path / "keys.txt", tmp_path / "key.txt"
    keys_file.write_text(_keys_text())
    single_file.write_text(SINGLE + "\n")
    srv = Server(bundle_dir, tmp_path / "data", "--api-keys-file", str(keys_file),
                 "--api-key-file", str(single_file)).start()
    vectors = np.random.default_rng(0).standard_normal((6, DIM)).round(4).tolist()
    try:
        with srv.client() as c:
            assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200
            for headers in ({}, _auth("nope"), {"Authorization": f"Basic {READ}"}, _auth(_sha(READ))):
                r = c.get("/info", headers=headers)
                assert r.status_code == 401 and "API key" in r.json()["error"], headers
            r = c.get("/no/such/route", headers=_auth(READ))
            assert r.status_code == 403 and r.json()["missing_scope"] == "admin"  # fail closed off the table
            assert c.get("/no/such/route", headers=_auth(SINGLE)).status_code == 404
            assert c.get("/no/such/route").status_code == 401
            # read: reads work, every mutating route is refused before its body is read, naming the scope
            assert c.get("/info", headers=_auth(READ)).status_code == 200
            assert c.get("/index", headers=_auth(READ)).status_code == 200
            for method, path, scope in _mutating():
                r = c.request(method, path, headers=_auth(READ), json={})
                assert r.status_code == 403, (method, path, r.text)
                assert r.json()["missing_scope"] == scope and f"'{scope}' scope" in r.json()["error"], r.text
            # write: index and classifier changes, not admin
            r = c.post("/index/t/add", headers=_auth(WRITE), json={"ids": list(range(6)), "vectors": vectors})
            assert r.status_code == 200, r.text
            r = c.post("/fewshot/fit", headers=_auth(WRITE),
                       json={"name": "f", "labels": ["a", "b"] * 3, "embeddings": vectors})
            assert r.status_code == 201, r.text
            assert c.post("/index/t/search", headers=_auth(WRITE), json={"vectors": vectors[:1], "k": 2}).is_success
            r = c.post("/admin/snapshot", headers=_auth(WRITE))
            assert r.status_code == 403 and r.json()["missing_scope"] == "admin"
            # admin only: publish, but not read
            assert c.post("/admin/snapshot", headers=_auth(ADMIN)).status_code == 200
            r = c.get("/index", headers=_auth(ADMIN))
            assert r.status_code == 403 and r.json()["missing_scope"] == "read"
            # the one-key setting: every scope
            assert c.post("/index/t/delete", headers=_auth(SINGLE), json={"ids": [5]}).status_code == 200
            assert c.post("/admin/snapshot", headers=_auth(SINGLE)).status_code == 200
            assert c.get("/info", headers=_auth(SINGLE)).status_code == 200

            # revoked by rewriting the file (mtime poll, at most a second)
            tmp = keys_file.with_suffix(".new")
            tmp.write_text(_keys_text(read_key=OTHER))
            os.replace(tmp, keys_file)
            deadline = time.monotonic() + 5
            while c.get("/info", headers=_auth(READ)).status_code != 401:
                assert time.monotonic() < deadline, "revoked key still accepted 5 s after the keys file changed"
                time.sleep(0.2)
            assert c.get("/info", headers=_auth(OTHER)).status_code == 200

            # revoked by SIGHUP: an in-place edit the mtime poll cannot see (same size, mtime put back)
            stamp = keys_file.stat()
            with open(keys_file, "r+") as f:
                f.write(_keys_text(read_key=READ))  # same length as the text it replaces
            os.utime(keys_file, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
            time.sleep(1.2)
            assert c.get("/info", headers=_auth(OTHER)).status_code == 200  # the poll saw no change
            srv.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 5
            while c.get("/info", headers=_auth(OTHER)).status_code != 401:
                assert time.monotonic() < deadline, "revoked key still accepted 5 s after SIGHUP"
                time.sleep(0.1)
            assert c.get("/info", headers=_auth(READ)).status_code == 200

            # a keys file that no longer parses keeps the keys in force
            keys_file.write_text("root nonsense\n")
            time.sleep(1.2)
            assert c.get("/info", headers=_auth(READ)).status_code == 200
        assert srv.alive()
    finally:
        srv.stop()
    log = srv.log()
    assert "API keys file" in log and "dashboard" in log and "not reloaded" in log
    for secret in (READ, WRITE, ADMIN, OTHER, SINGLE):
        assert secret not in log and hashlib.sha256(secret.encode()).hexdigest() not in log, secret


def test_bad_keys_file_refuses_to_start(bundle_dir: Path, tmp_path: Path):
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"read {READ}\nsuperuser {WRITE}\n")
    srv = Server(bundle_dir, tmp_path / "data", "--api-keys-file", str(keys_file))
    with pytest.raises((RuntimeError, TimeoutError), match="keys.txt:2: unknown scope"):
        srv.start(timeout=60)
    assert READ not in srv.log() and WRITE not in srv.log()
