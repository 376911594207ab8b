"""One progress bar for a whole evaluation run, readable on a terminal and in a log file.

On a terminal it is a single tqdm bar. Anywhere else (a log file, a pipe, CI) it writes a plain line at most every
`interval` seconds and at the end: `zero-shot: 13,915/139,153 requests (10%), 2m31s elapsed, about 22m40s left`,
instead of the carriage-return updates a bar writes, which a log shows as thousands of lines.
"""

from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class Progress:
    """`with Progress(total, "zero-shot", unit="requests") as bar: ... bar.update(n)`."""

    def __init__(self, total: int, desc: str, *, unit: str = "requests", stream=None, interval: float = 30.0,
                 enabled: bool = True, terminal: bool | None = None):
        self.total, self.desc, self.unit, self.interval = int(total), desc, unit, interval
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and self.total > 0
        self.terminal = terminal if terminal is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.done, self._bar, self._start, self._last = 0, None, time.monotonic(), float("-inf")
        if self.enabled and self.terminal:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit=f" {unit}", file=self.stream, dynamic_ncols=True)

    def line(self) -> str:
        elapsed = time.monotonic() - self._start
        text = f"{self.desc}: {self.done:,}/{self.total:,} {self.unit} ({100 * self.done / self.total:.0f}%), " \
               f"{_duration(elapsed)} elapsed"
        if 0 < self.done < self.total:
            text += f", about {_duration(elapsed * (self.total - self.done) / self.done)} left"
        return text

    def update(self, count: int = 1) -> None:
        self.done = min(self.total, self.done + int(count))
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(count)
            return
        now = time.monotonic()
        if now - self._last >= self.interval or self.done == self.total:
            self._last = now
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
