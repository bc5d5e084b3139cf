"""Masks from clients: a request's ``mask`` specification (or ``keep_idx`` rows) -> the kept patches of each image.

The one place the service resolves a mask (:func:`msn_core.masks.resolve_masks`, the resolution training and the
visualizer share) and the one translation of its :class:`~msn_core.masks.MaskError` into a client's error: 422 on
``/embed``, ``/v1`` and the services, 400 under the Open Inference Protocol, whose every input error is a 400.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from msn_core.masks import MaskError, resolve_masks
from msn_serve.errors import ApiError


class MaskRejected(ApiError):
    """A mask (a ``mask`` specification or ``keep_idx`` rows) that cannot be applied: 422, or 400 under the Open
    Inference Protocol, whose every input error is a 400. ``param`` is the request field OpenAI's error object names."""

    param = "mask"


@contextlib.contextmanager
def rejecting_masks(status: int = 422) -> Iterator[None]:
    """The one translation of :class:`msn_core.masks.MaskError` for clients (every route and service uses it)."""
    try:
        yield
    except MaskError as e:
        raise MaskRejected(status, str(e)) from None


def request_keep_idx(spec: Any, count: int, grid: int, *, status: int = 422) -> list[np.ndarray]:
    """A request's ``mask`` -> the ``keep_idx`` row of each of its ``count`` images on the model's patch ``grid``:
    the one resolution (:func:`msn_core.masks.resolve_masks`) and error of ``/embed``, ``/v1``, OIP and the services."""
    with rejecting_masks(status):
        return resolve_masks(spec, count, grid)
