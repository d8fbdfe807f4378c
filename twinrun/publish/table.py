"""The tidy table: a row per run × unit (σ bin, training segment) × estimand, across runs and sweeps;
the JSON stays the record.

`frame(paths, load_index)` reads each run directory (or every point of a sweep directory) through the
validated owners (RunIndex, RunDir.read_summary), each as its kind says (`load_index`, handed down:
twinrun.table.load passes the registry's), and returns a pandas DataFrame; `rows` is the same as plain
dicts. Every row carries every resolved setting of its run's intervention arm (`probe.*`,
`intervention.*`, `sigma_grid.*`, …, defaults too), so runs group by protocol without knowing what each
overrode; launcher and tracker settings are not columns (they are not science). A training row carries
its segment's losses. A sweep adds, under `row_kind` "pooled over seeds", its σ × estimand pooled across
seeds (twinrun.publish.seeds). pandas and pyarrow are the `table` extra (`pip install 'twinrun[table]'`).
"""

import io
import json
from pathlib import Path

from twinrun.arms import EXCLUDED, flatten
from twinrun.errors import StoreError, TwinrunError
from twinrun.files import write_output
from twinrun.publish.seeds import pool_seeds
from twinrun.publish.sweep import collect_points
from twinrun.storage.rundir import RunDir, RunIndex
from twinrun.storage.sweepdir import SweepDir, point_overrides

try:  # the `table` extra; without it rows() still works and load() says how to install it
    import pandas as pd
except ImportError:
    pd = None

EXTRA_HINT = "pip install 'twinrun[table]' (pandas and pyarrow)"
# The columns every row has, in this order; an effect row's further fields follow (a training row's
# losses among them), then every resolved setting of the arm's config and the overrides.
COLUMNS = ("row_kind", "run_dir", "sweep_dir", "verdict", "checks_passed", "passed", "measure", "unit_index",
           "unit", "sigma", "estimand", "gate", "gate_passed", "below_noise", "effect", "cos", "se", "cos_lo",
           "cos_hi", "norm_ratio", "norm_ratio_se", "norm_ratio_lo", "norm_ratio_hi", "cos_naive", "norm2",
           "norm2_se", "norm2_base", "norm2_base_se", "t_crit", "pairing_rho", "pairing_gain",
           "kernel_path_sha256", "seed", "twinrun_version", "twinrun_commit")
VERDICTS = {True: "valid", False: "instrument broken", None: "not reduced"}


def run_dirs(path: Path) -> tuple[list[Path], Path | None]:
    """(the run directories at `path`, the sweep directory or None): a run, or every point of a sweep."""
    path = Path(path)
    if RunDir(path).is_run():
        return [path], None
    sd = SweepDir(path)
    if not sd.is_sweep():
        raise StoreError(path, "holds no run.json and no sweep point: give a run or a sweep directory")
    return sd.point_dirs(), path


def _at(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _overrides(run_dir: Path, config: dict) -> dict:
    """Every science override Hydra recorded for the run as a column: the resolved (typed) value where
    the config has the key, else the override's text (`+experiment=pin_sigma` → experiment: pin_sigma).
    How the run was launched or logged (launcher.*, hydra.*, tracker.*) is no column: not science."""
    out = {}
    for o in point_overrides(run_dir):
        key, _, text = o.lstrip("+~").partition("=")
        if key.split(".")[0].split("/")[0] in EXCLUDED:
            continue
        value = _at(config, key)
        out[key] = value if isinstance(value, bool | int | float | str) else text
    return out


def settings(config: dict) -> dict:
    """Every resolved setting of the arm's config as a column (`probe.n_images`, `intervention.sigma_pin`,
    …), overridden or default alike, so runs concatenate without NaN in what they share: a scalar as its
    own type, a list or mapping as its JSON text. The arm's config holds no launcher or tracker setting."""
    out = {}
    for key, value in flatten(config).items():
        if key in COLUMNS:
            continue
        out[key] = value if isinstance(value, bool | int | float | str) or value is None else \
            json.dumps(value, sort_keys=True)
    return out


def loss_fields(summary: dict | None, step) -> dict:
    """A training segment's losses (the intervention's and the twin's, the paired held-out difference)
    as columns; {} for a probe's row or a step with none."""
    found = {r.get("role"): r for r in (summary or {}).get("losses", []) if r.get("step") == step}
    arm, twin = found.get("intervention"), found.get("twin")
    if arm is None and twin is None:
        return {}
    arm, twin = arm or {}, twin or {}
    return {"train_loss": arm.get("train_loss"), "heldout_loss": arm.get("heldout_loss"),
            "heldout_se": arm.get("heldout_se"), "twin_train_loss": twin.get("train_loss"),
            "twin_heldout_loss": twin.get("heldout_loss"), "twin_heldout_se": twin.get("heldout_se"),
            "heldout_diff": arm.get("heldout_diff"), "heldout_diff_se": arm.get("heldout_diff_se"),
            "heldout_diff_significant": arm.get("heldout_diff_significant")}


def _interval(row: dict, key: str, se_key: str) -> tuple:
    """An interval as the summary gives it (`cos_interval` [lo, hi]) or value ± t_crit · SE."""
    given = row.get(f"{key}_interval")
    if isinstance(given, list) and len(given) == 2:
        return tuple(given)
    if row.get(key) is None or row.get(se_key) is None:
        return None, None
    half = row["t_crit"] * row[se_key]
    return row[key] - half, row[key] + half


def _effect_fields(row: dict | None) -> dict:
    """An effect row's numbers, its intervals split in lo/hi, its other scalar fields as they come."""
    if row is None:
        return {}
    scalars = {k: v for k, v in row.items() if isinstance(v, bool | int | float | str) or v is None}
    cos_lo, cos_hi = _interval(row, "cos", "se")
    ratio_lo, ratio_hi = _interval(row, "norm_ratio", "norm_ratio_se")
    return {**scalars, "effect": None if row.get("cos") is None else 1 - row["cos"], "cos_lo": cos_lo,
            "cos_hi": cos_hi, "norm_ratio_lo": ratio_lo, "norm_ratio_hi": ratio_hi}


def _version(summary: dict | None) -> dict:
    found = (summary or {}).get("twinrun")
    found = found if isinstance(found, dict) else {}
    return {"twinrun_version": found.get("version"), "twinrun_commit": found.get("commit")}


def run_rows(run_dir: Path, load, sweep_dir: Path | None = None) -> list[dict]:
    """One row per unit × estimand of one run: its effects, or (broken, not reduced) rows without numbers.
    `load`: run_dir -> (RunIndex, its measurement kind) (measures/registry.py: load_index); the kind says
    how its summary names a unit (`unit_key`) and which of the unit's own fields holds it (`unit_own`)."""
    index, kind = load(run_dir)
    rd = index.run_dir
    config = index.arm_config(index.arm("intervention")["name"])  # held to run.json's config_hash
    summary = rd.read_summary(kind.summary_type) if rd.has_summary() else None
    passed = None if summary is None else summary["passed"]
    field = kind.unit_key
    effects = {(e[field], e["estimand"]): e for e in (summary or {}).get("effects", [])}
    gates: dict = {}  # (unit, estimand) -> passed; training gates are per step, every estimand
    for g in (summary or {}).get("gates", []):
        key = (g[field], g.get("estimand"))
        gates[key] = gates.get(key, True) and g["passed"]
    estimands = (summary or {}).get("used", {}).get("estimands") or index.registered["estimands"]
    shared = {"row_kind": "run", "run_dir": str(run_dir),
              "sweep_dir": None if sweep_dir is None else str(sweep_dir), "verdict": VERDICTS[passed],
              "checks_passed": None if summary is None else summary["checks_passed"], "passed": passed,
              "measure": index.measure, "seed": config.get("seed"), **_version(summary)}
    # Every setting and override of the run becomes a column, so rows of different runs and sweeps line up in
    # one table; a name that is one of twinrun's own columns never overwrites it.
    overrides = {k: v for k, v in {**settings(config), **_overrides(run_dir, config)}.items()
                 if k not in COLUMNS}
    rows = []
    for u in index.units:
        own = index.params(u)
        # The unit's kernel path, so a table of many runs shows which numbers share an environment.
        paths = {e.get("kernel_path_sha256") for e in u["stores"].values()} - {None}
        for name in estimands:
            key = (own.get(kind.unit_own), name)
            rows.append({**shared, "unit_index": u["index"], "unit": u["label"], **own, "estimand": name,
                         "gate": u["gate"], "gate_passed": gates.get(key, gates.get((key[0], None))),
                         "kernel_path_sha256": ",".join(sorted(paths)) or None,
                         **_effect_fields(effects.get(key)), **loss_fields(summary, key[0]), **overrides})
    return rows


def pooled_rows(sweep_dir: Path, load) -> list[dict]:
    """A sweep's σ × estimand pooled over seeds (points alike in every override but `seed`)."""
    out, typed = [], {}
    for c in pool_seeds(collect_points(SweepDir(sweep_dir), load)):
        first = Path(c["run_dirs"][0])
        if first not in typed:  # the group's shared overrides, typed as the run rows type them
            index = RunIndex.load(first)
            config = index.arm_config(index.arm("intervention")["name"])
            typed[first] = {**settings(config), **_overrides(first, config)}
        numbers = {k: v for k, v in c.items() if k.startswith(("effect_", "norm_ratio_"))}
        out.append({"row_kind": "pooled over seeds", "sweep_dir": str(sweep_dir), "sigma": c["sigma"],
                    "estimand": c["estimand"], "effect": c["effect_mean"], "norm_ratio": c["norm_ratio_mean"],
                    "n_seeds": c["n_seeds"], "seeds": ",".join(map(str, c["seeds"])), **numbers,
                    **{k: v for k, v in typed[first].items() if k not in COLUMNS},
                    **{k: typed[first].get(k, v) for k, v in c["fixed"].items() if k not in COLUMNS}})
    return out


def rows(paths: list[Path], load) -> list[dict]:
    """Every row of every run (and sweep) named, in the order given (`load`: as run_rows takes it)."""
    out = []
    for path in paths:
        runs, sweep_dir = run_dirs(path)
        for run_dir in runs:
            out += run_rows(run_dir, load, sweep_dir)
        if sweep_dir is not None:
            out += pooled_rows(sweep_dir, load)
    return out


def frame(paths, load_index) -> "pd.DataFrame":
    """The tidy table of the runs and sweeps at `paths` (one path or several) as a pandas DataFrame."""
    if pd is None:
        raise TwinrunError(f"twinrun.table needs pandas: {EXTRA_HINT}")
    paths = [paths] if isinstance(paths, str | Path) else list(paths)
    found = rows([Path(p) for p in paths], load_index)
    extra = list(dict.fromkeys(k for r in found for k in r if k not in COLUMNS))
    return pd.DataFrame(found, columns=[*COLUMNS, *extra])


def write(df: "pd.DataFrame", path: Path, fmt: str) -> Path:
    """The table as CSV or parquet, written atomically (a half-written table never replaces a whole one),
    onto a new name or a regular file only."""
    buf = io.BytesIO()
    if fmt == "parquet":
        try:
            df.to_parquet(buf, index=False)
        except ImportError as err:
            raise TwinrunError(f"--parquet {path}: needs pyarrow ({err}): {EXTRA_HINT}") from None
    else:
        buf.write(df.to_csv(index=False).encode())
    # A user's path: a new name or a regular file only (never through a link, never over a device node).
    return write_output(Path(path), buf.getvalue(), "table")
