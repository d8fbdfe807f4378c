"""The worked plugin example (examples/twinrun_activation) installed offline onto a temporary path: its
package copied and a dist-info written from its own pyproject.toml, as pip would, so importlib.metadata
finds its entry points exactly as it finds an installed package's."""

import shutil
from pathlib import Path

import tomllib

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "twinrun_activation"


def install_example(target: Path) -> Path:
    """Install the example under `target` (a directory to put on PYTHONPATH); returns `target`."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    shutil.copytree(EXAMPLE / "twinrun_activation", target / "twinrun_activation")
    info = target / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                                   f"Version: {project['version']}\n")
    groups = project["entry-points"]
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items()) + "\n"
        for group, points in groups.items()))
    return target
