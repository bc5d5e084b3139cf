"""The app's one way to call a running ``msn-serve``: :class:`msn_serve.client.Client` (its retries included), with
the service's failures shown in the page as one message instead of a traceback.

A client per step: the panels' sessions live in Gradio's state, which holds no open connections.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import gradio as gr

from msn_serve.client import APIConnectionError, APIStatusError, Client

__all__ = ["service_client"]


@contextmanager
def service_client(url: str, api_key: str = "", timeout: float = 300.0) -> Iterator[Client]:
    """A client for ``url`` (blank: ``MSN_BASE_URL``; key blank: ``MSN_API_KEY``); its errors as ``gr.Error``."""
    try:
        with Client(url or None, api_key=api_key or None, timeout=timeout) as client:
            yield client
    except APIConnectionError as exc:
        raise gr.Error(f"Cannot reach msn-serve at {url}: {exc.message}") from None
    except APIStatusError as exc:
        raise gr.Error(f"msn-serve: {exc.status_code} {exc.message}") from None
