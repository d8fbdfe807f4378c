"""The run's log: what a run's process prints also goes to its log file in the run directory."""

import contextlib
import os
import stat
import sys
from pathlib import Path


@contextlib.contextmanager
def tee_output(log: Path):
    """What this process prints also goes to the run's log file (Hydra's job log, else empty)."""
    try:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError:
        yield  # no log beats no run (a link at its name is never written through); errors come later, named
        return
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:  # a hard link: its other name is outside the run
        os.close(fd)
        yield
        return
    f = os.fdopen(fd, "a", encoding="utf-8")
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(streams[0], f), _Tee(streams[1], f)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams
        f.close()


class _Tee:
    """A text stream writing to the terminal and to a log file (the log never breaks the run)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        try:
            self.log.write(text)
        except (OSError, ValueError):
            pass
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()
        try:
            self.log.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):  # isatty, fileno, encoding... are the terminal's
        return getattr(self.stream, name)
