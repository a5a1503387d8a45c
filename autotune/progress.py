"""A textual progress bar: redrawn in place on a terminal, one line a step in a log."""
from __future__ import annotations

import sys


class ProgressBar:
    def __init__(self, total: int, *, enabled: bool = True, stream=None, width: int = 30):
        self.total, self.done, self.width = max(total, 1), 0, width
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._tty = getattr(self.stream, "isatty", lambda: False)()

    def step(self, label: str = "") -> None:
        self.done = min(self.done + 1, self.total)
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        line = f"[{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total} {label}"
        if self._tty:
            self.stream.write("\r" + line.ljust(self.width + 60))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()
