"""The kind seam (docs/architecture.md, "A measurement kind"): the rooms every kind shares ask a kind
what they need through its Measure (measures/kind.py), handed down to them, and never name one. A new
kind is then its own files plus one registration (measures/registry.py, or a plugin's entry point)."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KINDS = ("probe", "train", "sample")
# The rooms that serve every kind: neither a kind's name in their code (a string, an attribute) nor an
# import of a kind's own module (one named for it: measures/probe.py, storage/train_store.py, ...).
NEUTRAL = ["twinrun/storage/records.py", "twinrun/storage/rundir.py", "twinrun/publish/__init__.py",
           "twinrun/compare.py", "twinrun/publish/trackers/__init__.py", "twinrun/publish/table.py",
           "twinrun/publish/sweep.py",
           "twinrun/storage/store_meta.py", "twinrun/storage/run_paths.py",
           "twinrun/pipeline.py", "twinrun/env.py", "twinrun/status.py", "twinrun/table.py",
           "twinrun/measures/registry.py", "twinrun/plugins.py", "twinrun/job.py", "twinrun/plan.py",
           "twinrun/resume.py", "twinrun/reduce.py", "twinrun/app.py", "twinrun/sweep.py",
           "twinrun/analysis/reduction.py", "twinrun/analysis/vouch.py", "twinrun/measures/failures.py",
           *(str(p.relative_to(REPO)) for p in sorted((REPO / "twinrun" / "launchers").glob("*.py")))]
# Each may still name a kind where the built-in table is declared: the one registration.
REGISTRATION = {("twinrun/measures/registry.py", "twinrun.measures.probe"),
                ("twinrun/measures/registry.py", "twinrun.measures.train"),
                ("twinrun/measures/registry.py", "twinrun.measures.sample")}


def _kind_named(text: str) -> bool:
    return text in KINDS or text.startswith(tuple(f"{k}." for k in KINDS))


def _own_module(module: str) -> bool:
    return module.rpartition(".")[2].startswith(KINDS)


def namings(path: Path) -> list[str]:
    """Where the file's code (docstrings and comments aside) names a measurement kind."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and n.body and isinstance(n.body[0], ast.Expr)
                  and isinstance(n.body[0].value, ast.Constant)}
    rel = str(path.relative_to(REPO))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if _kind_named(node.value):
                found.append(f"{rel}:{node.lineno}: the string {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr in KINDS:
            found.append(f"{rel}:{node.lineno}: the attribute .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                for module in (node.module, f"{node.module}.{a.name}"):
                    if _own_module(module) and (rel, module) not in REGISTRATION:
                        found.append(f"{rel}:{node.lineno}: imports {module}")
        elif isinstance(node, ast.Import):
            found += [f"{rel}:{node.lineno}: imports {a.name}" for a in node.names
                      if _own_module(a.name) and (rel, a.name) not in REGISTRATION]
    return found


@pytest.mark.parametrize("room", NEUTRAL)
def test_a_kind_neutral_room_names_no_kind(room):
    assert namings(REPO / room) == []


def test_the_check_sees_a_kind_named_in_code_and_not_in_prose(tmp_path):
    # The rule proven on a file that breaks it, and on one that only speaks of kinds in its prose.
    bad = REPO / "tests" / "_kind_neutral_probe_tmp.py"
    try:
        bad.write_text('"""Reads the probe\'s runs."""\nfrom twinrun.storage.train_store import x\n'
                       'def f(cfg):\n    """probe"""\n    return cfg.probe.compile, {"probe": 1}\n')
        found = namings(bad)
        assert len(found) == 3 and "imports twinrun.storage.train_store" in found[0], found
        bad.write_text('"""The probe and train kinds."""\n# probe\nX = "a probe of training"\n')
        assert namings(bad) == []
    finally:
        bad.unlink(missing_ok=True)
