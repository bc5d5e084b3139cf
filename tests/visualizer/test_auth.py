"""The visualizer's login: with an auth file or the msn-serve API key, neither the app nor its API answers without
logging in; with the right password both work."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from visualizer.app import password_check

KEY = "viz-key-123"


def test_password_check_reads_users_and_the_key(tmp_path: Path) -> None:
    users = tmp_path / "users"
    users.write_text("# who may log in\nalice:wonder\nbob:builder\n")
    key = tmp_path / "key"
    key.write_text(KEY + "\n")
    check = password_check(users, key)
    assert check("alice", "wonder") and check("bob", "builder") and check("anyone", KEY)
    assert not check("alice", "builder") and not check("carol", "wonder") and not check("alice", "")
    only_key = password_check(api_key_file=key)
    assert only_key("x", KEY) and not only_key("alice", "wonder")
    assert password_check() is None
    (tmp_path / "bad").write_text("no-colon-here\n")
    with pytest.raises(ValueError, match="user:password"):
        password_check(tmp_path / "bad")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        password_check(api_key_file=tmp_path / "empty")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_app_and_its_api_need_the_login(tiny_bundle: Path, tiny_run: Path, sample_png: Path,
                                            tmp_path: Path) -> None:
    from gradio_client import Client, handle_file

    from visualizer.app import launch

    (tmp_path / "key").write_text(KEY)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    demo = launch(tiny_bundle, tiny_run, port=port, block=False, auth=password_check(api_key_file=tmp_path / "key"))
    try:
        assert httpx.get(url + "config").status_code == 401
        assert httpx.get(url + "gradio_api/info").status_code == 401
        with pytest.raises(Exception):  # noqa: B017 - gradio_client's error type differs between versions
            Client(url, verbose=False).predict(handle_file(str(sample_png)), "random", 0.5, 0, 0.5, api_name="/load")
        with pytest.raises(Exception):  # noqa: B017
            Client(url, auth=("someone", "wrong"), verbose=False)
        client = Client(url, auth=("someone", KEY), verbose=False)
        _, status = client.predict(handle_file(str(sample_png)), "random", 0.5, 0, 0.5, api_name="/load")
        assert status.startswith("32/64 patches kept")
    finally:
        demo.close()
