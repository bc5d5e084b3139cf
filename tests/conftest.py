"""Suite-wide guard: no test leaves an OpenMP runtime changed for the tests that share its worker process.

An xdist worker runs many modules in one process: torch, faiss-cpu and cyanure bound to one OpenMP runtime (torch's,
loaded with ``RTLD_GLOBAL``). A cyanure fit turns on the runtime's dynamic thread adjustment, after which torch's
convolution backward in any later test of that worker could spin for ever (``msn_core.openmp``). The product keeps
the settings (``openmp_kept`` around every fit); this guard puts back whatever a test changed (a thread count set
by a speed-timing test, say) and fails the test that switched the dynamic adjustment on, naming it, instead of
letting a later test hang.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from msn_core.openmp import openmp_kept, openmp_state


@pytest.fixture(autouse=True)
def _openmp_settings_kept() -> Iterator[None]:
    with openmp_kept():
        yield
        turned_on = [state.path for state in openmp_state() if state.dynamic]
    if turned_on:
        pytest.fail(f"this test left OpenMP's dynamic thread adjustment on in {turned_on} (restored now): torch's "
                    "backward can spin for ever after that; run the native call inside msn_core.openmp.openmp_kept",
                    pytrace=False)
