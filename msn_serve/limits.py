"""Result-count limits checked before any work: a client controls ``queries x k``, the operator caps it."""
from __future__ import annotations

from msn_serve.errors import too_large


def check_results(queries: int, k: int, limit: int) -> None:
    """413 when ``queries`` x ``k`` results (k already capped at what exists) exceed ``limit``."""
    if queries * k > limit:
        raise too_large(f"{queries} queries x k={k} = {queries * k} results exceed the limit of {limit} "
                        "(max_results_per_request); send fewer queries or a smaller k")
