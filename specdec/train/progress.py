"""Progress bars of `specdec distill` on stderr (tqdm), or none with --no-progress."""

from __future__ import annotations

import sys

from tqdm import tqdm


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_postfix_str(self, text: str) -> None: ...
    def close(self) -> None: ...


def progress_bar(total: int | None, enabled: bool, description: str, unit: str, initial: int = 0):
    if not enabled:
        return _NoBar()
    # Logged to a file (nohup), a bar redrawn every 0.1 s would bury the log lines.
    interval = 0.1 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, initial=initial, desc=description, unit=unit, dynamic_ncols=True, mininterval=interval)
