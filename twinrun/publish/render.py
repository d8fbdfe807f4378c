"""Text a researcher reads: the reducer's printout, and the number formats report.md shares.

No number without its SE: a cosine or norm ratio is shown as `value ± se`, and a row below noise
shows each arm's debiased |μ|² ± SE instead, so one can see how far from signal it was.
"""


def pm(x: float | None, se: float | None, spec: str = ".4f", se_spec: str = ".1e") -> str:
    """`x ± se`, or "below noise" where the estimate was withheld."""
    return "below noise" if x is None else f"{x:{spec}} ± {se:{se_spec}}"


def analysis_head(summary: dict) -> str:
    """The line under a printout's title: the registered analysis, or a post-hoc view and where it went."""
    ph = summary.get("post_hoc")
    return (f"POST-HOC VIEW (registered {ph['registered']}, used {ph['used']}); written to {ph['view_dir']}"
            if ph else f"registered analysis (settings recorded at plan time: {summary['registered']})")


def interval_text(interval: list | None, spec: str = ".4f") -> str:
    """A printed interval `[lo, hi]`, asymmetric as computed; — for a side the data do not bound."""
    if interval is None:
        return ""
    return "[" + ", ".join("—" if x is None else f"{x:{spec}}" for x in interval) + "]"


def noise_note(row: dict) -> str:
    """Each arm's debiased squared norm ± SE (what decided "below noise")."""
    return (f"|μ|² = {row['norm2']:.2e} ± {row['norm2_se']:.1e}, "
            f"twin |μ|² = {row['norm2_base']:.2e} ± {row['norm2_base_se']:.1e}")


def verdict_line(summary: dict) -> str:
    if summary.get("post_hoc"):
        ph = summary["post_hoc"]
        return (f"POST-HOC VIEW (registered {ph['registered']}, used {ph['used']}); the registered analysis "
                f"{'passed' if ph['registered_passed'] else 'FAILED'} and stands. Written to "
                f"{ph['view_dir']}")
    return "registered analysis (settings recorded at plan time: " + str(summary["registered"]) + ")"


def render(summary: dict) -> str:
    lines = [f"twinrun reduce: {summary['run_dir']}", verdict_line(summary), "", "validity checks:"]
    lines += [f"  [{'ok' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}" for c in summary["checks"]]
    lines += ["", (f"no-op gates (rule: {summary['used']['gate_rule']}; intervention vs native twin where "
                   "the intervention does nothing):")]
    lines += [f"  [{'ok' if g['passed'] else 'FAIL'}] ({g['rule']}) {g['detail']}" for g in summary["gates"]]
    if summary.get("replicate"):
        lines += ["", f"replicate: {summary['replicate']['detail']}"]
    if summary.get("reference"):
        lines += ["", summary["reference"]["detail"]]
    if not summary["passed"]:
        lines += ["", ("INSTRUMENT BROKEN: a validity check or no-op gate failed. Effects are withheld; "
                       "nothing else from this run should be read.")]
        return "\n".join(lines)
    lines += ["", ("effects (debiased cos and norm ratio |μ_arm| / |μ_twin| to the twin, ± jackknife SE, and "
                   "95% intervals given that the row printed, — where unbounded; 1 − cos is the change of "
                   "direction, the ratio the change of size):"),
              (f"  {'σ':>6}  {'estimand':<9} {'cos ± se':>22} {'interval':>18} {'norm ratio ± se':>22} "
               f"{'interval':>18}")]
    for x in summary["effects"]:
        if x["below_noise"]:
            lines.append(f"  {x['sigma']:>6g}  {x['estimand']:<9} {'below noise':>22} ({noise_note(x)})")
            continue
        near = f"  near the detection boundary: {noise_note(x)}" if x.get("near_boundary") else ""
        lines.append(f"  {x['sigma']:>6g}  {x['estimand']:<9} {pm(x['cos'], x['se']):>22} "
                     f"{interval_text(x.get('cos_interval')):>18} "
                     f"{pm(x['norm_ratio'], x['norm_ratio_se']):>22} "
                     f"{interval_text(x.get('norm_ratio_interval')):>18}{near}")
    if summary.get("family"):
        lines += ["", f"family-wise: {summary['family']['detail']}"]
    return "\n".join(lines)
