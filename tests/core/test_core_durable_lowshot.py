"""msn_core.durable (atomic replace, no leftovers, readable permissions, durable removal, quarantine, the data
directory's lock) and msn_core.lowshot (the one fit)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from msn_core.durable import (
    atomic_write,
    atomic_write_json,
    clean_temp_files,
    lock_data_dir,
    quarantine,
    remove_durably,
)
from msn_core.lowshot import DEFAULT_LAMBD, LinearClassifier, center_and_normalize, fit_logistic


def test_atomic_write_replaces_and_leaves_nothing_behind(tmp_path: Path):
    target = tmp_path / "sub" / "state.bin"
    atomic_write(target, b"one")
    atomic_write(target, lambda f: f.write(b"two"))
    assert target.read_bytes() == b"two"
    mode = stat.S_IMODE(target.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # not mkstemp's 0600: other users (the serving account) read bundles

    def fail(f):
        f.write(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        atomic_write(target, fail)
    assert target.read_bytes() == b"two" and sorted(p.name for p in target.parent.iterdir()) == ["state.bin"]
    atomic_write_json(tmp_path / "x.json", {"a": [1, 2]})
    assert (tmp_path / "x.json").read_text() == '{\n "a": [\n  1,\n  2\n ]\n}\n'


def test_removal_quarantine_and_leftover_cleaning(tmp_path: Path):
    data = tmp_path / "data"
    (data / "indexes" / "a").mkdir(parents=True)
    (data / "indexes" / "a" / "wal.bin").write_bytes(b"x")
    (data / "one.npz").write_bytes(b"y")
    remove_durably(data / "indexes" / "a")
    remove_durably(data / "one.npz")
    remove_durably(data / "never-there")  # a missing file is already removed
    assert sorted(p.name for p in data.rglob("*")) == ["indexes"]

    (data / "bad.npz").write_bytes(b"not a classifier")
    moved = quarantine(data, data / "bad.npz", "does not parse")
    assert not (data / "bad.npz").exists() and moved.parent == data / "quarantine"
    assert moved.read_bytes() == b"not a classifier" and moved.name.endswith("-bad.npz")

    (data / ".x.npz.1.abcd.tmp").write_bytes(b"half")  # an interrupted atomic write
    (data / ".gone.deleted.123").mkdir()  # an interrupted removal
    (data / "quarantine" / ".kept.tmp").write_bytes(b"evidence")
    clean_temp_files(data)
    assert sorted(p.relative_to(data).as_posix() for p in data.rglob("*")) == [
        "indexes", "quarantine", "quarantine/.kept.tmp", moved.relative_to(data).as_posix()]


def test_the_data_directory_lock_admits_one_process(tmp_path: Path):
    fd = lock_data_dir(tmp_path, owner="msn-serve")
    try:
        assert (tmp_path / ".lock").read_text() == str(os.getpid())
        code = ("import sys; from pathlib import Path; from msn_core.durable import lock_data_dir\n"
                "try:\n    lock_data_dir(Path(sys.argv[1]), owner='msn-serve')\n"
                "except OSError as e:\n    print(e)")
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                           check=True, cwd=Path(__file__).resolve().parents[2])
        assert r.stdout.strip() == f"data directory {tmp_path} is in use by another msn-serve process"
    finally:
        os.close(fd)  # the kernel drops the lock with the descriptor (or the process)
    os.close(lock_data_dir(tmp_path, owner="msn-serve"))


def _blobs(n_per: int, classes: int, dim: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, dim)) * 3
    x = np.concatenate([c + rng.standard_normal((n_per, dim)) for c in centres])
    return x, np.repeat(np.arange(classes), n_per)


def test_default_lambda_is_the_official_one():
    assert DEFAULT_LAMBD == 0.00025


@pytest.mark.parametrize("classes", [2, 4])
def test_fit_with_string_labels_predicts_and_gives_probabilities(classes: int):
    x, y = _blobs(6, classes)
    names = np.array([f"class-{i}" for i in y])
    model = fit_logistic(np.asfortranarray(x), names)  # Fortran order: cyanure's own preprocess would be a no-op
    assert isinstance(model, LinearClassifier) and model.coef.shape == (16, classes)
    assert model.accuracy(x, names) == 1.0 and list(model.classes) == sorted(set(names))
    np.testing.assert_allclose(model.probabilities(x).sum(axis=1), 1.0)
    same = fit_logistic(x, names)
    np.testing.assert_allclose(same.coef, model.coef)  # seeded: the same fit every time


def test_rows_are_centred_and_unit_norm():
    x = center_and_normalize(np.asfortranarray(np.arange(12.0).reshape(3, 4)))
    assert x.flags.c_contiguous and x.dtype == np.float64
    np.testing.assert_allclose(x.mean(axis=1), 0, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1)


@pytest.mark.parametrize("labels, lambd, needle", [
    (["a"] * 8, DEFAULT_LAMBD, "2 distinct labels"), (["a", "b"] * 3, DEFAULT_LAMBD, "6 labels for 8"),
    (["a", "b"] * 4, 0.0, "lambd"), (["a", "b"] * 4, float("nan"), "lambd"),
])
def test_unusable_fits_are_value_errors(labels, lambd, needle):
    x, _ = _blobs(4, 2)
    with pytest.raises(ValueError, match=needle):
        fit_logistic(x, np.asarray(labels), lambd=lambd)
    x[0, 0] = np.inf
    with pytest.raises(ValueError, match="NaN or infinity"):
        fit_logistic(x, np.asarray(["a", "b"] * 4))
