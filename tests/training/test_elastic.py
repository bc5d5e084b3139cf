"""torchrun (2 processes, gloo): the uninterrupted run's per-rank state, and under --max-restarts a rank killed mid-run
(the writer inside a checkpoint write, or another rank before the launch's first checkpoint) and the run still ends
bit-identical to an uninterrupted one. The kills come from the trainer's test hook (``MSN_TEST_KILL_AT``,
training/checkpoint.py ``fault_point``), so each run fails at the same place every time. Each torchrun launch costs
three interpreters (and three more per restart): the uninterrupted launch is shared by every test here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.checkpoint import KILL_AT, fault_point, launch_id, load_checkpoint

from .test_pretrain import PRETRAIN, _args, _assert_same_state, _env

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# 64 images / (4 per rank * 2 ranks) = 8 steps per epoch: step 3 is mid-epoch, the run crosses an epoch end
RUN = ["run.max_steps=10", "run.checkpoint_every_steps=3", "data.batch_size=4", "run.device=cpu"]


def _torchrun(output_dir: Path, kill_at: str | None = None) -> str:
    """One torchrun launch (2 workers, up to 2 restarts) with the same command line every time; its output."""
    env = {k: v for k, v in _env().items() if k != KILL_AT and not k.startswith("TORCHELASTIC_")}
    if kill_at is not None:
        env[KILL_AT] = kill_at
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=2", PRETRAIN, *_args(output_dir, RUN)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The reference: the same launch with no failure (its directory)."""
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    output = _torchrun(output_dir)
    assert "resumed from" not in output
    state = load_checkpoint(output_dir / "checkpoint.pt")
    assert state["step"] == 10 and state["world_size"] == 2
    return output_dir


def _reference(output_dir: Path) -> dict:
    return load_checkpoint(output_dir / "checkpoint.pt")


@pytest.mark.slow
def test_two_process_gloo_run_seeds_ranks_apart_shares_masks_and_only_rank_0_logs(uninterrupted):
    """The uninterrupted launch itself (no test pays a separate one for this): both ranks' RNG state is stored, the
    ranks augment differently (different seeds) but share masks (same mask generator seed), and only rank 0 logs."""
    state = _reference(uninterrupted)
    assert state["world_size"] == 2 and state["step"] == 10 and len(state["rng"]) == 2
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])
    assert torch.equal(state["rng"][0]["mask"], state["rng"][1]["mask"])
    # 64 images / (4 per rank * 2 ranks) = 8 steps per epoch; logged every step by rank 0 alone: 10 lines, not 20
    assert state["steps_per_epoch"] == 8
    assert len((uninterrupted / "metrics.jsonl").read_text().splitlines()) == 10


@pytest.mark.slow
def test_writer_killed_inside_a_checkpoint_write_restarts_from_the_previous_one_bit_identical(tmp_path, uninterrupted):
    """rank 0 (the writer) dies while step 6's checkpoint is half written: checkpoint.pt must still be step 3's,
    complete; the restart removes the interrupted write's temporary file, resumes this launch's step 3 (as this
    launch, whose id it keeps writing) and ends bit-identical. A rank killed outside a write takes the same restart
    path (its kill, of rank 1, is the earlier-launch test's), so no separate launch pays for that case."""
    output = _torchrun(tmp_path, kill_at="checkpoint-write:6:0")
    assert "left by an interrupted checkpoint write" in output, output[-4000:]
    assert "at step 3 (epoch 0, batch 3) after torchrun restart 1" in output, output[-4000:]
    assert not list(tmp_path.glob(".checkpoint*.tmp"))
    final = load_checkpoint(tmp_path / "checkpoint.pt")
    _assert_same_state(_reference(uninterrupted), final)
    assert final["launch"] == launch_id(tmp_path, restarted=True)  # the restart kept writing as this launch


@pytest.mark.slow
def test_rank_killed_before_the_first_checkpoint_never_resumes_one_from_an_earlier_launch(tmp_path, uninterrupted):
    # the directory holds a finished run (an earlier launch); a fresh launch into it (no --resume) loses rank 1 at
    # step 2, before its own first checkpoint: the restart starts over instead of continuing the earlier launch's
    # step 10, and ends bit-identical to the uninterrupted run
    for name in ("checkpoint.pt", "launch.json", "config.yaml"):
        shutil.copy(uninterrupted / name, tmp_path / name)
    output = _torchrun(tmp_path, kill_at="step:2:1")
    # A later restart may follow (gloo can abort at teardown after the restarted run finished): it resumes this
    # launch's own checkpoint, which is right. What must not happen is restart 1 resuming the earlier launch's.
    resumed = [line for line in output.splitlines() if "resumed from" in line]
    assert "is from an earlier launch" in output, output[-4000:]
    assert not any(line.endswith("after torchrun restart 1") for line in resumed), output[-4000:]
    _assert_same_state(_reference(uninterrupted), load_checkpoint(tmp_path / "checkpoint.pt"))


def test_launch_id_is_new_per_launch_and_read_back_on_restart(tmp_path):
    first = launch_id(tmp_path, restarted=False)
    assert launch_id(tmp_path, restarted=True) == first
    assert launch_id(tmp_path, restarted=False) != first
    assert launch_id(tmp_path / "missing", restarted=True) is None


def test_kill_hook_rejects_a_malformed_spec(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv(KILL_AT, "step:five:1")
    with pytest.raises(ValueError, match=KILL_AT):
        fault_point("step", 5)
    monkeypatch.setenv(KILL_AT, "step:5:1")
    monkeypatch.setenv("RANK", "0")
    fault_point("step", 5)  # another rank's kill: this process lives on
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    fault_point("step", 5)  # a restarted worker runs past the kill point
