"""A low-shot fit must not break torch in the same process.

cyanure ships its own OpenMP runtime; after a multi-threaded fit, torch's two-thread convolution backward in the same
process ran for minutes instead of milliseconds (it stalled the visualizer tests after the int8 guard's in-process
fit). The fit defaults to one thread; this runs the sequence in a child process so a regression fails by timeout
instead of hanging the suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from msn_core.lowshot import fit_logistic
    rng = np.random.default_rng(0)
    fit_logistic(rng.normal(size=(200, 32)).astype(np.float32), rng.integers(0, 10, 200))
    conv = torch.nn.Conv2d(8, 8, 3, padding=1)
    for _ in range(20):
        conv(torch.randn(8, 8, 16, 16)).square().sum().backward()
    print("done")
""")


def test_torch_runs_normally_after_a_lowshot_fit_in_the_same_process():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("done")
