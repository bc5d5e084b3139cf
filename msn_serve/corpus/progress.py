"""A progress bar for ``msn-embed``: tqdm's when tqdm is installed (the training extra has it, the serve extra need
not), else one plain line on stderr (rewritten in place on a terminal, a new line every ``every_s`` seconds in a
log), so a long run on a slim serving image still says how far it is and how fast it goes."""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from msn_core.optional import optional


class Progress:
    """``update(n, skipped)`` after each batch; ``close()`` at the end. ``total`` is the images still to embed."""

    def __init__(self, total: int, *, desc: str = "msn-embed", stream: TextIO | None = None, every_s: float = 10.0,
                 use_tqdm: bool = True) -> None:
        self.total, self.desc, self.done, self.skipped = total, desc, 0, 0
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self._t0 = self._last = time.perf_counter()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar: Any = None
        if use_tqdm and (bars := optional("tqdm.auto")) is not None:
            self._bar = bars.tqdm(total=total, desc=desc, unit="img", file=self.stream, smoothing=0.1)

    def update(self, n: int, skipped: int = 0) -> None:
        self.done += n
        self.skipped += skipped
        if self._bar is not None:
            self._bar.update(n)
            if skipped:
                self._bar.set_postfix(skipped=self.skipped)
            return
        now = time.perf_counter()
        if now - self._last >= (0.5 if self._tty else self.every_s):
            self._last = now
            self._write(self.line(), final=False)

    def line(self) -> str:
        """``msn-embed: 1,200/60,000 images (2.0 %), 512 img/s, 3 skipped, about 1m55s left``."""
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        rate = self.done / elapsed
        pct = 100.0 * self.done / self.total if self.total else 100.0
        text = f"{self.desc}: {self.done:,}/{self.total:,} images ({pct:.1f} %), {rate:,.0f} img/s"
        if self.skipped:
            text += f", {self.skipped} skipped"
        if 0 < self.done < self.total and rate > 0:
            left = int((self.total - self.done) / rate)
            text += f", about {left // 60}m{left % 60:02d}s left"
        return text

    def _write(self, text: str, *, final: bool) -> None:
        if self._tty:
            self.stream.write("\r" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.total:
            self._write(self.line(), final=True)
