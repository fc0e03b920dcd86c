"""One report of a bad command-line flag per job, then exit code 2.

Every rank of a launched job parses the same flags and fails the same way, so
rank 0 alone prints the reason. The other ranks must not leave first: torchrun
stops the whole job on the first rank that exits, and if that is rank 1 it can
terminate rank 0 before rank 0 has printed anything (seen in CI when rank 0 was
slower to import). So they wait, a bounded time, for the launcher to stop them
once rank 0 has reported and exited.
"""
from __future__ import annotations

import os
import sys
import time

EXIT_CODE = 2
#: How long a rank other than 0 waits for the launcher before exiting by itself.
LAUNCHER_GRACE_S = 30.0


def report_bad_flag(line: str, wait_s: float = LAUNCHER_GRACE_S) -> int:
    """Print ``line`` on rank 0 (stderr); on other ranks wait ``wait_s``. Returns 2."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(wait_s)
    return EXIT_CODE
