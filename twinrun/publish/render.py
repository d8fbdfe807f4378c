"""Text a researcher reads: the reducer's printout, and the number formats report.md shares.

No number without its SE: a cosine or norm ratio is shown as `value ± se`, and a row below noise
shows each arm's debiased |μ|² ± SE instead, so one can see how far from signal it was.
"""

import math


def pm(x: float | None, se: float | None, spec: str = ".4f", se_spec: str = ".1e") -> str:
    """`x ± se`, or "below noise" where the estimate was withheld."""
    return "below noise" if x is None else f"{x:{spec}} ± {se:{se_spec}}"


def analysis_head(summary: dict) -> str:
    """The line under a printout's title: the registered analysis, or a post-hoc view and where it went."""
    ph = summary.get("post_hoc")
    return (f"POST-HOC VIEW (registered {ph['registered']}, used {ph['used']}); written to {ph['view_dir']}"
            if ph else f"registered analysis (settings recorded at plan time: {summary['registered']})")


def interval_text(interval: list | None, spec: str = ".4f", whole: str = "−1 to 1") -> str:
    """A printed interval `[lo, hi]`, asymmetric as computed; — for a side the data do not bound, and
    where neither side is bound, why: the interval given printing spans the quantity's whole range
    (`whole`: "−1 to 1" for a cosine, "0 to ∞" for a ratio), so the value ± SE is all the row says."""
    if interval is None:
        return ""
    text = "[" + ", ".join("—" if x is None else f"{x:{spec}}" for x in interval) + "]"
    if all(x is None for x in interval):
        text += f" (unbounded: given that it printed, the data allow every value from {whole})"
    return text


def family_text(family: dict, effects: list[dict]) -> str:
    """The family-wise reading in words, counting apart the rejected rows that print a number and those
    below noise (there the arms differ, but no cosine or ratio says how)."""
    if not family["n_hypotheses"]:
        return f"0 effect rows read; family-wise (Holm, α={family['level']:g}): nothing to read."
    below = {(e["sigma"], e["estimand"]) for e in effects if e.get("below_noise")}
    rejected = [(r["sigma"], r["estimand"]) for r in family["rejected"]]
    named = lambda rows: ", ".join(f"σ={s:g} {e}" for s, e in rows)
    shown, hidden = [r for r in rejected if r not in below], [r for r in rejected if r in below]
    if not rejected:
        found = "no row shows an effect"
    else:
        found = (f"an effect in {len(shown)} {'row' if len(shown) == 1 else 'rows'} with a number"
                 + (f" ({named(shown)})" if shown else ""))
        if hidden:
            found += (f"; {len(hidden)} below-noise {'row' if len(hidden) == 1 else 'rows'} reject no effect "
                      f"too ({named(hidden)}): the arms differ there, but no cosine or ratio says how")
    holm = f"family-wise (Holm, α={family['level']:g})"
    return (f"{family['n_rows']} effect rows read ({family['n_hypotheses']} distinct hypotheses of no "
            f"effect: `residual` tests what `all` tests); {holm}: {found}.")


def reading_text(effects: list[dict]) -> str | None:
    """What the printed rows say together, in a few sentences (None: no row printed a number). Where rows
    sit near the detection boundary it says which arm's |μ|² put them there, what is still bounded (the
    ratio's lower ends) and, from the pairing receipt's draw share, whether more draws or more images
    would sharpen them (docs/estimator.md, "Rows near the boundary"). Each sentence is said only where
    every row it speaks of bears it out."""
    rows = [e for e in effects if not e["gate"] and not e["below_noise"]]
    if not rows:
        return None
    n, gates = len(rows), sum(1 for e in effects if e["gate"])
    bounded = lambda key: sum(1 for e in rows if e.get(key) and None not in e[key])
    besides = f" (besides {gates} gate {'row' if gates == 1 else 'rows'})" if gates else ""
    rows_print = "row prints" if n == 1 else "rows print"
    said = [(f"{n} effect {rows_print} a number{besides}: {bounded('cos_interval')} of {n} cosine intervals "
             f"and {bounded('norm_ratio_interval')} of {n} norm-ratio intervals are bounded on both sides.")]
    near = [(e, *_weaker_arm(e)) for e in rows if e.get("near_boundary")]
    near = [(e, arm, z) for e, arm, z in near if math.isfinite(z)]  # (an exact row is never marked)
    if not near:
        return " ".join(said)
    twin_weak = sum(1 for _, arm, _ in near if arm == "twin")
    who = ("the twin's" if twin_weak == len(near) else "the intervention's" if not twin_weak
           else f"the weaker arm's (the twin's in {twin_weak})")
    said.append(f"{len(near)} of {n} sit near the detection boundary: there {who} |μ|² is only "
                f"{_span([z for _, _, z in near], '.1f')} SE above zero, so the test of signal shaped their "
                "intervals.")
    if twin_weak < len(near):
        return " ".join(said)
    # The twin barely detected in every one: what the ratio (its denominator the twin's) still bounds.
    ends = [e.get("norm_ratio_interval") or [None, None] for e, _, _ in near]
    if all(lo is not None and lo > 1 for lo, _ in ends):
        open_above = sum(1 for _, hi in ends if hi is None)
        said.append(f"The change of size is still clear: in each of them the intervention's |μ| is at "
                    f"least {min(lo for lo, _ in ends):.3g}× the twin's (the ratio's lower ends)"
                    + (f"; in {open_above} the data do not bound how much larger." if open_above else "."))
    shares = [e["draw_share"] for e, _, _ in near if e.get("draw_share") is not None]
    if shares and max(shares) < DRAWS_BARELY:
        said.append(f"In the {len(shares)} of them with a pairing receipt the draws carry "
                    f"{_span([100 * x for x in shares], '.0f')}% of the twin's noise and the images the "
                    "rest, so more draws (probe.n_draws) would barely sharpen them; more images would "
                    "(probe.n_images, or more data where the run already reads all it has).")
    return " ".join(said)


# Under this draw share, even infinitely many draws would shrink the twin's SE by under 14% (1 − √0.75).
DRAWS_BARELY = 0.25


def _weaker_arm(row: dict) -> tuple[str, float]:
    """The arm whose debiased |μ|² stands fewer SEs above zero, and how many (nan where unknown)."""
    z = {"twin": _z(row["norm2_base"], row["norm2_base_se"]),
         "intervention": _z(row["norm2"], row["norm2_se"])}
    if any(math.isnan(v) for v in z.values()):
        return "twin", math.nan
    arm = min(z, key=z.get)
    return arm, z[arm]


def _z(value, se) -> float:
    if value is None or se is None or not se > 0:
        return math.nan
    return value / se


def _span(values: list[float], spec: str) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:{spec}}" if f"{lo:{spec}}" == f"{hi:{spec}}" else f"{lo:{spec}}–{hi:{spec}}"


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
    # A failed run prints why and stops: a broken instrument's effects are never printed.
    if not summary["passed"]:
        lines += ["", ("INSTRUMENT BROKEN: a validity check or no-op gate failed. Effects are withheld; "
                       "nothing else from this run should be read.")]
        return "\n".join(lines)
    lines += ["", ("effects (debiased cos and norm ratio |μ_arm| / |μ_twin| to the twin, ± jackknife SE, and "
                   "95% intervals given that the row printed, — where unbounded; 1 − cos is the change of "
                   "direction, the ratio the change of size):"),
              (f"  {'σ':>6}  {'estimand':<9} {'cos ± se':>22} {'interval':>18} {'norm ratio ± se':>22} "
               f"{'interval':>18}")]
    # A row below noise prints the arms' |μ|² in place of a cos, so the reader sees why it has no number.
    for x in summary["effects"]:
        if x["below_noise"]:
            lines.append(f"  {x['sigma']:>6g}  {x['estimand']:<9} {'below noise':>22} ({noise_note(x)})")
            continue
        near = f"  near the detection boundary: {noise_note(x)}" if x.get("near_boundary") else ""
        lines.append(f"  {x['sigma']:>6g}  {x['estimand']:<9} {pm(x['cos'], x['se']):>22} "
                     f"{interval_text(x.get('cos_interval')):>18} "
                     f"{pm(x['norm_ratio'], x['norm_ratio_se']):>22} "
                     f"{interval_text(x.get('norm_ratio_interval'), whole='0 to ∞'):>18}{near}")
    reading = reading_text(summary["effects"])
    if reading:
        lines += ["", f"reading: {reading}"]
    if summary.get("family"):
        lines += ["", f"family-wise: {family_text(summary['family'], summary['effects'])}"]
    return "\n".join(lines)
