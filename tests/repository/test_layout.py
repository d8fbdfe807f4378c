"""The package's layers point one way: no import circles, no import inside a function to dodge one, no
import that climbs back up a floor, and the declared line length enforced by the linter."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "twinrun"

# Top to bottom: a module may import modules of its own floor (without a circle) or of any floor below.
FLOORS = [
    ("command lines", ["twinrun.__main__", "twinrun.app", "twinrun.resume", "twinrun.sweep", "twinrun.reduce",
                       "twinrun.status", "twinrun.compare", "twinrun.diff", "twinrun.env", "twinrun.train",
                       "twinrun.table"]),
    ("orchestration", ["twinrun.pipeline"]),
    ("launching", ["twinrun.launchers"]),
    ("the job", ["twinrun.job", "twinrun.cold_check"]),
    ("planning", ["twinrun.plan"]),
    ("measurement", ["twinrun.measures"]),
    ("analysis and presentation", ["twinrun.analysis", "twinrun.publish"]),
    ("components", ["twinrun.arms", "twinrun.model", "twinrun.data", "twinrun.draws", "twinrun.conditioning",
                    "twinrun.caches", "twinrun.lora", "twinrun.models"]),
    ("storage", ["twinrun.storage"]),
    ("provenance", ["twinrun.provenance"]),
    ("schema", ["twinrun.config", "twinrun.protocol", "twinrun.instantiate", "twinrun.intervention_nodes",
                "twinrun.interventions", "twinrun.objectives", "twinrun.errors", "twinrun.files",
                "twinrun.run_log", "twinrun"]),
]
COMMANDS = set(FLOORS[0][1])
# Side by side on one floor, neither reads the other: the reducer hands a summary to publish.
APART = [("twinrun.analysis", "twinrun.publish")]
# Imports deferred inside a function on purpose, each for start-up time (never to dodge a circle).
DEFERRED = {("twinrun/provenance/switches.py", "torch._inductor.config"),
            ("twinrun/provenance/switches.py", "torch.compiler.config"),
            ("twinrun/provenance/kernel_pin.py", "torch._inductor.select_algorithm"),
            ("twinrun/provenance/kernel_pin.py", "torch._dynamo.utils"),
            ("twinrun/provenance/kernel_pin.py", "torch.compiler._cache")}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def floor(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    assert best is not None, f"{module} is on no floor of tests/repository/test_layout.py: give it one"
    return best[0]


def imports(path: Path, known: dict) -> list[tuple[str, int, bool]]:
    """(imported twinrun module, line, inside a function) for every import of the package in a file."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names
                             if a.name.startswith("twinrun"))
            elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith("twinrun"):
                for a in child.names:  # `from twinrun.measures import fold_sums` imports a submodule
                    sub = f"{child.module}.{a.name}"
                    found.append((sub if sub in known else child.module, child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: {t for t, _, _ in imports(p, known)} - {m} for m, p in known.items()}


def test_every_module_has_a_floor():
    for module in modules():
        floor(module)


def test_no_import_climbs_a_floor_and_no_command_imports_another():
    known = modules()
    bad = []
    for module, path in known.items():
        for target, line, _ in imports(path, known):
            if floor(target) < floor(module):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {target} "
                           f"({FLOORS[floor(target)][0]}, above {FLOORS[floor(module)][0]})")
            alias = module == "twinrun.__main__" and target == "twinrun.app"  # `python -m twinrun` is the app
            if module in COMMANDS and target in COMMANDS and target != module and not alias:
                bad.append(f"{path.relative_to(REPO)}:{line}: a command line imports another ({target})")
            for a, b in APART:
                if ((module.startswith(a) and target.startswith(b))
                    or (module.startswith(b) and target.startswith(a))):
                    bad.append(f"{path.relative_to(REPO)}:{line} imports {target}: {a} and {b} stay apart")
    assert not bad, "\n".join(bad)


def test_no_import_inside_a_function():
    known = modules()
    bad = [f"{p.relative_to(REPO)}:{line} imports {t} inside a function" for m, p in known.items()
           for t, line, inside in imports(p, known) if inside]
    assert not bad, "\n".join(bad)
    # Not only the package's own modules: a deferred third-party import must be one of the few that
    # save start-up time, listed above with the reason in a comment beside it.
    deferred = set()
    for path in PACKAGE.rglob("*.py"):
        for f in ast.walk(ast.parse(path.read_text())):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(f):
                    if isinstance(node, ast.Import):
                        deferred |= {(path.relative_to(REPO).as_posix(), a.name) for a in node.names}
                    elif isinstance(node, ast.ImportFrom):
                        deferred.add((path.relative_to(REPO).as_posix(), node.module))
    assert deferred <= DEFERRED, sorted(deferred - DEFERRED)


def test_no_import_circle():
    g = graph()
    seen, stack, cycles = set(), [], []

    def walk(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for t in sorted(g.get(m, ())):
            if t.startswith(m + ".") or m == "twinrun":  # a package's __init__ importing its own rooms
                continue
            walk(t)
        stack.pop()

    for m in sorted(g):
        walk(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_layering_test_catches_a_climb(tmp_path, monkeypatch):
    """The rule itself can fail: a storage room importing the job is reported."""
    fake = {"twinrun.storage.x": tmp_path / "x.py"}
    fake["twinrun.storage.x"].write_text("from twinrun.job import run_job\n")
    found = imports(fake["twinrun.storage.x"], {"twinrun.job": None})
    assert floor(found[0][0]) < floor("twinrun.storage.x")


def test_lint_enforces_the_declared_line_length():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    out = subprocess.run([ruff, "check", "--output-format", "concise", "."], cwd=REPO, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    # The rule is on: a line one column over the limit is refused.
    long_line = tmp_line = REPO / ".ruff_probe_tmp.py"
    try:
        tmp_line.write_text("x = '" + "a" * 200 + "'\n")
        probe = subprocess.run([ruff, "check", "--output-format", "concise", str(long_line)], cwd=REPO,
                               capture_output=True, text=True, check=False)
    finally:
        tmp_line.unlink(missing_ok=True)
    assert "E501" in probe.stdout


def test_the_probes_arithmetic_imports_torch_alone():
    """benchmarks/bench_gpu.py imports the probe's arithmetic on a GPU image that may lack Hydra,
    OmegaConf and PyYAML: measures/fold_sums.py must not pull them in (through a package __init__)."""
    heavy = "{'hydra', 'omegaconf', 'yaml', 'submitit'}"
    code = ("import sys, twinrun.measures.fold_sums; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {heavy}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
