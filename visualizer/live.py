"""A decoder run the app follows while it trains: the newest checkpoint is sampled, and none is waited for.

``make demo`` opens the app as soon as the service is up and trains the decoder beside it: masks and nearest
neighbours work at once, sampling starts with the run's first checkpoint (every ``run.checkpoint_every_steps``) and
sharpens with each next one. The run's ``config.yaml`` (written when training starts) says what the controls
offer before a checkpoint exists; each call to :meth:`LiveDecoder.current` looks at ``checkpoint.pt`` (written
atomically, so never half-read) and loads it again when it changed.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import yaml

from visualizer.config import RCDMConfig, recorded_config
from visualizer.features import FrozenEncoder
from visualizer.pipeline import RCDMPipeline, decoder_kind, decoder_summary, load_run

__all__ = ["DecoderNotReady", "LiveDecoder"]

log = logging.getLogger("msn.visualize")


class DecoderNotReady(ValueError):
    """No checkpoint yet: the message says so, and what works meanwhile."""


class LiveDecoder:
    """The decoder of run directory ``run`` on ``bundle``, as of its newest checkpoint."""

    def __init__(self, bundle: str | Path, run: str | Path, *, device: str = "cpu", wait_s: float = 60.0):
        self.bundle, self.run, self.device = Path(bundle), Path(run), device
        self._pipe: RCDMPipeline | None = None
        self._stamp: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self.config = self._wait_for_config(wait_s)
        self.encoder = FrozenEncoder(self.bundle, backend=self.config.cond.backend, device=device,
                                     feature=self.config.cond.feature)
        self.name = self.bundle.name
        self.current()

    @property
    def checkpoint(self) -> Path:
        return self.run / "checkpoint.pt"

    def _wait_for_config(self, wait_s: float) -> RCDMConfig:
        """The run's config: its checkpoint's, else the ``config.yaml`` training writes first (waited for)."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.checkpoint.is_file():
                return recorded_config(load_run(self.checkpoint)["config"])
            if (self.run / "config.yaml").is_file():
                return recorded_config(yaml.safe_load((self.run / "config.yaml").read_text()) or {})
            if time.monotonic() >= deadline:
                raise FileNotFoundError(f"no decoder checkpoint or config.yaml in {self.run} after {wait_s:.0f} s "
                                        "(train one with `msn-visualize train --output-dir RUN`)")
            time.sleep(0.5)

    @property
    def kind(self) -> str:
        """What the decoder is (:func:`visualizer.pipeline.decoder_kind`), known from the config before a
        checkpoint exists."""
        return decoder_kind(self.config, self.encoder.feature, spatial=self.encoder.layout.side > 0)

    @property
    def guidance_trained(self) -> bool:
        pipe = self._pipe
        return pipe.guidance_trained if pipe is not None else self.config.diffusion.cond_drop_prob > 0

    def guidance(self, requested: float | None = None) -> float:
        pipe = self._pipe
        if pipe is not None:
            return pipe.guidance(requested)
        return self.config.diffusion.guidance_scale if self.guidance_trained else 1.0

    def current(self) -> RCDMPipeline | None:
        """The pipeline of the newest checkpoint (loaded again when the file changed); None before the first."""
        try:
            st = self.checkpoint.stat()
        except FileNotFoundError:
            return self._pipe
        stamp = (st.st_mtime_ns, st.st_size)
        with self._lock:
            if stamp != self._stamp:
                try:
                    self._pipe = RCDMPipeline.from_dirs(self.bundle, self.run, device=self.device)
                    self._stamp = stamp
                    log.info("decoder %s: step %d loaded", self.run, self._pipe.step)
                except (OSError, ValueError, RuntimeError, EOFError) as e:  # replaced meanwhile: the next call retries
                    log.warning("decoder checkpoint %s not loaded (%s); keeping the previous one", self.checkpoint, e)
            return self._pipe

    def require(self) -> RCDMPipeline:
        pipe = self.current()
        if pipe is None:
            every = self.config.run.checkpoint_every_steps
            raise DecoderNotReady(f"The decoder is still training and has no checkpoint yet (the first comes at step "
                                  f"{every}; {self.run}): masks and nearest neighbours work meanwhile.")
        return pipe

    def summary(self) -> str:
        """The app's header line: the decoder's step and quality, or that it is still training."""
        pipe = self.current()
        if pipe is None:
            return (f"Decoder ({self.kind}): training (run `{self.run}`), no checkpoint yet; the first comes at step "
                    f"{self.config.run.checkpoint_every_steps:,}, and this page loads each new one by itself.")
        text = decoder_summary(pipe)
        if pipe.quality is None:  # quality is measured when a training invocation ends
            text += " Still training: each new checkpoint is loaded as it lands."
        return text
