"""End-to-end pretraining runs on CPU: a single process, and exact resume after SIGKILL (2-process gloo under torchrun:
test_elastic.py). One uninterrupted run serves as both the single-process run and the SIGKILL test's reference."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from training.checkpoint import load_checkpoint

from .pretrain_here import pretrain_here

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = str(REPO / "training" / "pretrain.py")
TINY = [
    "data.source=synthetic", "data.synthetic_size=64", "data.load_size=16", "data.batch_size=8",
    "data.num_workers=0", "model.arch=vit_tiny", "model.image_size=16", "model.patch_size=4",
    "model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.head_hidden_dim=64",
    "model.head_out_dim=16", "model.num_prototypes=32", "mask.focal_size=8", "mask.num_focal=2",
    "mask.ratio=0.5", "optim.epochs=3", "optim.warmup_epochs=1", "run.log_every_steps=1",
    "run.progress_bar=false",
]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _args(output_dir: Path, extra: list[str]) -> list[str]:
    args = ["--output-dir", str(output_dir)]
    for item in TINY + extra:
        args += ["--set", item]
    return args


def _run(output_dir: Path, extra: list[str], *, resume: bool = False) -> None:
    cmd = [sys.executable, PRETRAIN, *_args(output_dir, extra)] + (["--resume"] if resume else [])
    subprocess.run(cmd, check=True, env=_env(), timeout=300, capture_output=True)


def _assert_same_state(a: dict, b: dict) -> None:
    for key in ("encoder", "head", "target_encoder", "target_head"):
        for name, tensor in a[key].items():
            assert torch.equal(tensor, b[key][name]), f"{key}.{name} differs"
    assert torch.equal(a["prototypes"], b["prototypes"])
    for pid, state in a["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg"], b["optimizer"]["state"][pid]["exp_avg"])
    assert (a["step"], a["epoch"], a["batch_in_epoch"]) == (b["step"], b["epoch"], b["batch_in_epoch"])


# 64 images / batch 8 = 8 steps per epoch: step 14 is mid-epoch 1, with an epoch end (step 8) and checkpoints on the way
LENGTH = ["run.max_steps=14", "run.checkpoint_every_steps=3"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """One single-process run, uninterrupted, with TensorBoard and epoch checkpoints on (logging only: the SIGKILL
    test's runs, without them, must still end on the same bits)."""
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    _run(output_dir, [*LENGTH, "run.tensorboard=true", "run.keep_epoch_checkpoints=1"])
    return output_dir


def test_single_process_run_writes_checkpoint_and_metrics(uninterrupted):
    state = load_checkpoint(uninterrupted / "checkpoint.pt")
    assert state["step"] == 14 and state["world_size"] == 1 and (state["epoch"], state["batch_in_epoch"]) == (1, 6)
    epoch_end = load_checkpoint(uninterrupted / "checkpoint-ep0001.pt")  # kept at the epoch end
    assert (epoch_end["step"], epoch_end["epoch"], epoch_end["batch_in_epoch"]) == (8, 1, 0)
    assert state["encoder_kwargs"]["embed_dim"] == 32 and state["preprocessing"]["crop"] == 16
    records = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 15))
    assert all(r["loss"] == r["loss"] and r["prototype_usage_entropy"] > 0 for r in records)
    assert (uninterrupted / "config.yaml").exists()
    assert any((uninterrupted / "tensorboard").glob("events.out.tfevents.*"))
    # The online and target encoders move apart (EMA) and prototypes are trained.
    qkv = "blocks.0.attn.qkv.weight"
    assert not torch.equal(state["encoder"][qkv], state["target_encoder"][qkv])


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path, uninterrupted):
    total, interrupted = LENGTH, tmp_path / "interrupted"
    cmd = [sys.executable, PRETRAIN, *_args(interrupted, total)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = interrupted / "checkpoint.pt"
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            if checkpoint.exists() and load_checkpoint(checkpoint)["step"] >= 3:
                break
            assert proc.poll() is None, "training exited before it could be killed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    killed_at = load_checkpoint(checkpoint)
    assert 3 <= killed_at["step"] < 14 and killed_at["batch_in_epoch"] != 0, "kill should land mid-epoch"

    _run(interrupted, total, resume=True)
    _assert_same_state(load_checkpoint(uninterrupted / "checkpoint.pt"), load_checkpoint(checkpoint))


def test_config_errors_are_reported_without_traceback(tmp_path, caplog):
    # in this process (main, as the command runs it): an error line needs no interpreter of its own
    message = pretrain_here(_args(tmp_path, ["optim.not_a_key=1"]), caplog)
    assert isinstance(message, str) and message.startswith("pretrain: ") and "optim.not_a_key" in message
    assert "\n" not in message  # one line; any other exception (a traceback) would fail this test instead


def test_bf16_autocast_keeps_fp32_weights_and_finite_loss(tmp_path, caplog):
    # a whole run in this process: the checkpoint and metrics it writes are what this checks, not the process
    assert pretrain_here(_args(tmp_path, ["run.max_steps=2", "run.precision=bf16"]), caplog) is None
    state = load_checkpoint(tmp_path / "checkpoint.pt")
    assert state["precision"] == "bf16" and state["encoder"]["blocks.0.attn.qkv.weight"].dtype == torch.float32
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["precision"] == "bf16" for r in records)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
