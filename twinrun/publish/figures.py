"""A figure written as a PNG file: every kind's plots and the sweep's heatmap are saved this one way."""

import io
from pathlib import Path

from twinrun.files import atomic_write


def save_figure(fig, path: Path) -> None:
    """PNG bytes written atomically: a full disk or a read-only directory is one StoreError line
    naming the file (exit 2), and a half-written plot never replaces a whole one."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write(Path(path), buf.getvalue())
