"""OpenMP settings a native library changes are put back (``msn_core.openmp``).

The cause, checked in a fresh interpreter so the import order is the product's (torch first, as in ``msn-eval`` and
the visualizer): cyanure's fit binds to torch's OpenMP runtime and leaves its dynamic thread adjustment on, the
setting under which torch's convolution backward spun for minutes in the suite; ``openmp_kept`` and
``fit_logistic`` leave torch's runtime as they found it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from msn_core.openmp import loaded_runtimes, openmp_kept, openmp_state

CHILD = textwrap.dedent("""
    import json, numpy as np, torch
    from cyanure.estimators import Classifier
    from msn_core.lowshot import fit_logistic
    from msn_core.openmp import openmp_kept, openmp_state

    def torch_runtime():
        return next(s for s in openmp_state() if "/torch/" in s.path)

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(300, 16)), rng.integers(0, 3, 300)
    out = {"before": torch_runtime().__dict__, "torch_threads_before": torch.get_num_threads()}
    with openmp_kept():
        Classifier(loss="multiclass-logistic", penalty="l2", lambda_1=1e-3, fit_intercept=False, n_threads=1,
                   verbose=False).fit(x, y)
        out["during_raw_fit"] = torch_runtime().__dict__
    out["after_kept"] = torch_runtime().__dict__
    for threads in (1, 2):
        fit_logistic(x, y, n_threads=threads)
        out[f"after_fit_logistic_{threads}"] = torch_runtime().__dict__
    out["torch_threads_after"] = torch.get_num_threads()
    conv = torch.nn.Conv2d(3, 16, 7, stride=7)
    conv(torch.randn(8, 3, 28, 28)).square().sum().backward()  # the kind of backward that spun
    print(json.dumps(out))
""")


def test_a_cyanure_fit_changes_torchs_runtime_and_is_put_back():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert not out["before"]["dynamic"]
    # the cause: a plain fit switches the adjustment on and drops the thread count in torch's own runtime
    assert out["during_raw_fit"]["dynamic"] and out["during_raw_fit"]["max_threads"] == 1
    for key in ("after_kept", "after_fit_logistic_1", "after_fit_logistic_2"):
        assert out[key] == out["before"], key
    assert out["torch_threads_after"] == out["torch_threads_before"]


def test_openmp_kept_restores_what_the_body_changed_in_this_process():
    import ctypes

    runtimes = loaded_runtimes()
    if not runtimes:  # the suite's workers have torch or numpy's runtimes mapped; a bare interpreter may not
        return
    lib = ctypes.CDLL(runtimes[0], mode=__import__("os").RTLD_NOLOAD)
    before = openmp_state()
    with openmp_kept():
        lib.omp_set_dynamic(1)
        lib.omp_set_num_threads(1)
        assert next(s for s in openmp_state() if s.path == runtimes[0]).dynamic
    assert openmp_state() == before
