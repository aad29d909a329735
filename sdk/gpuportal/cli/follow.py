"""Following a job: its state's exit code, and a replica's log read again and again for its new lines.

The API answers a replica's last lines (at most 5000); following reads them each second and prints
what was not printed yet, telling new lines from old ones by where the last answer's lines end.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from gpuportal.client import EXIT_JOB_FAILED, EXIT_OK

FINAL_STATES = {"succeeded": EXIT_OK, "failed": EXIT_JOB_FAILED, "cancelled": EXIT_JOB_FAILED}
# The lines the portal reads progress from (PORTAL_METRIC {...}, PORTAL_CHECKPOINT {...}); a person's
# view of a log leaves them out, as the portal's log download does.
PROGRESS_LINE = re.compile(r"^PORTAL_[A-Z_]+ \{")
TAIL_LINES = 200
TAIL_LINES_MAX = 5000


def exit_code(state: str) -> int | None:
    """0 for a job that succeeded, 1 for one that failed or was cancelled, None while it is not final."""
    return FINAL_STATES.get(state)


def is_progress_line(line: str) -> bool:
    return bool(PROGRESS_LINE.match(line))


def new_lines(previous: list[str], current: list[str], *, whole: bool) -> list[str] | None:
    """The lines of `current` that come after `previous` (both the last lines of one log).

    `whole`: `current` is the whole log (it had fewer lines than asked for), so `previous` is its
    start; its last line may have grown since (written in two pieces), and is then given again whole.
    Otherwise the two windows overlap where `previous` ends, and the longest overlap is taken. None
    when they do not overlap at all (more lines came than one answer holds).
    """
    if not previous:
        return current
    count = len(previous)
    if whole and current[:count] == previous:
        return current[count:]
    if (whole and len(current) >= count and current[:count - 1] == previous[:-1]
            and current[count - 1].startswith(previous[-1])):
        return current[count - 1:]
    for length in range(min(count, len(current)), 0, -1):
        if current[:length] == previous[-length:]:
            return current[length:]
    return None


class LogFollower:
    """One replica's log of one job, read over and over: `poll()` answers the lines that are new.

    `fetch(tail)` answers `{attempt, text}` (the logs API). A new attempt starts the log over, with a
    line saying so. Progress lines are left out unless `progress_lines`.
    """

    def __init__(self, fetch: Callable[[int], dict], *, progress_lines: bool = False):
        self.fetch = fetch
        self.progress_lines = progress_lines
        self.attempt: int | None = None
        self.window: list[str] = []

    def poll(self) -> list[str]:
        answer = self.fetch(TAIL_LINES)
        out: list[str] = []
        if answer.get("attempt") != self.attempt:
            if self.attempt is not None:
                out.append(f"--- attempt {answer.get('attempt')} ---")
            self.attempt, self.window = answer.get("attempt"), []
        lines = (answer.get("text") or "").splitlines()
        fresh = new_lines(self.window, lines, whole=len(lines) < TAIL_LINES)
        if fresh is None:
            answer = self.fetch(TAIL_LINES_MAX)
            lines = (answer.get("text") or "").splitlines()
            fresh = new_lines(self.window, lines, whole=len(lines) < TAIL_LINES_MAX)
            if fresh is None:
                out.append("--- (more lines came than one read holds; some were left out) ---")
                fresh = lines
        self.window = lines
        out.extend(line for line in fresh if self.progress_lines or not is_progress_line(line))
        return out
