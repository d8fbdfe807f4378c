"""What every kind's reduction shares: the Reduction it returns (the registered summary and a post-hoc
view), the settings it registered and uses, a check row, the provenance checks every kind's units are
held to, and the name of a view's directory. The kinds' own analyses (analysis/probe_reduce.py for the σ
probe, analysis/train_reduce.py for training) build on it."""

import re
from dataclasses import dataclass

from twinrun.config import ReduceConfig
from twinrun.errors import EXIT_GATE, EXIT_OK
from twinrun.storage.rundir import RunIndex


@dataclass
class Reduction:
    """One reduction of a run: the registered summary, and a post-hoc view when asked for one."""

    index: RunIndex
    summary: dict  # the registered analysis, recomputed from the stores
    view: dict | None = None  # the post-hoc view (other settings), None for the registered analysis
    view_name: str | None = None  # its directory under RUN/views/

    @property
    def shown(self) -> dict:
        """What the command prints: the view when there is one, else the registered summary."""
        return self.view if self.view is not None else self.summary

    @property
    def exit_code(self) -> int:
        """0 only if the registered analysis passed (a post-hoc view never turns a failure into 0)."""
        ok = self.summary["passed"] and (self.view is None or self.view["passed"])
        return EXIT_OK if ok else EXIT_GATE


def check(name: str, passed: bool, detail: str) -> dict:
    return {"name": name, "passed": bool(passed), "detail": detail}


def registered(index: RunIndex) -> dict:
    """The reduce settings registered at plan time."""
    defaults = ReduceConfig()
    reg = index.registered
    out = {"estimands": list(reg.get("estimands") or defaults.estimands),
           "gate_rule": reg.get("gate_rule", defaults.gate_rule),
           "signal_alpha": float(reg.get("signal_alpha", defaults.signal_alpha)),
           "family_alpha": float(reg.get("family_alpha", defaults.family_alpha))}
    if reg.get("groups"):  # named parameter groups (reduce.groups); absent when none were declared
        out["groups"] = {k: list(v) for k, v in reg["groups"].items()}
    return out


def used_settings(reg: dict, estimands=None, gate_rule=None, signal_alpha=None, family_alpha=None) -> dict:
    """The settings a reduction uses: the registered ones, each replaced where the command gave one (a
    post-hoc view when any differs)."""
    return {**reg, "estimands": list(estimands or reg["estimands"]),
            "gate_rule": gate_rule or reg["gate_rule"],
            "signal_alpha": float(reg["signal_alpha"] if signal_alpha is None else signal_alpha),
            "family_alpha": float(reg["family_alpha"] if family_alpha is None else family_alpha)}


def provenance_checks(index: RunIndex, stores: dict, unit: str = "bin") -> list[dict]:
    """Validity rule 3: each unit's arms ran in one process/node/boot/GPU/job on one kernel path,
    and the kernel-path sentinel read around the jobs never moved. `unit`: what the kind calls its units
    (bin, segment, chunk), the word the check's detail uses."""
    out = []
    # A unit's arms are twins only if they ran back to back in one process: a job, node, boot or GPU between
    # them is a difference the intervention did not make.
    split = {}
    for u in index.units:  # any kind's units (a probe's bins, a training run's segments)
        records = [s.meta.get("env") or {} for (n, i), s in stores.items() if i == u["index"]]
        fields = sorted({k for r in records for k in r if any(r.get(k) != o.get(k) for o in records)})
        if fields or not records[0]:
            split[u["index"]] = fields or ["(no record)"]
    out.append(check("same_allocation_per_bin", not split,
                     f"every {unit}'s arms ran back to back in one process (same job, node, boot, GPU)"
                     if not split else f"arms of a {unit} ran apart: "
                     + "; ".join(f"{unit} {i}: {', '.join(f)}" for i, f in split.items())))
    # Two kernel paths differ by a bias no averaging removes (docs/concepts.md): every store of a run on one.
    paths = {(s.meta.get("env") or {}).get("kernel_path_sha256") for s in stores.values()}
    out.append(check("one_kernel_path", len(paths) == 1 and None not in paths,
                     "every store was measured on one kernel path" if len(paths) == 1
                     else f"stores come from {len(paths)} kernel paths"))
    # The sentinel re-reads the kernel path around each job: a change during the run (a driver, an autotune
    # winner) would otherwise go unseen between the stores' own readings, and a job killed before its closing
    # reading has not shown it.
    jobs = index.jobs
    readings = ({j["sentinel_start"] for j in jobs}
                | {j["sentinel_end"] for j in jobs if j.get("sentinel_end")})
    readings |= {(s.meta.get("env") or {}).get("sentinel") for s in stores.values()}
    unclosed = bool(jobs) and jobs[-1].get("sentinel_end") is None
    ok = len(readings) == 1 and not unclosed
    detail = (f"sentinel identical at the start and end of all {len(jobs)} job(s)" if ok
              else "the last job ended without its closing sentinel reading: resume the run to take it"
              if len(readings) == 1 else
              f"the kernel-path sentinel changed during the run ({len(readings)} distinct readings)")
    out.append(check("sentinel_unchanged", ok, detail))
    return out


def view_name(reg: dict, used: dict) -> str:
    """A directory name saying what the post-hoc view changed, e.g. `gate_rule-bit_identical`."""
    parts = [f"{k}-{','.join(v) if isinstance(v, list) else v}" for k, v in used.items() if v != reg[k]]
    return re.sub(r"[^A-Za-z0-9_.,=-]", "_", "_".join(parts))
