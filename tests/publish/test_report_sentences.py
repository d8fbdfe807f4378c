"""The reports' sentences claim no more than was measured: each is built here from a summary that would
make its stronger wording false (no seed pair to pool, rejected rows that print below noise, an interval
bounded on neither side) and must say what it can."""

from twinrun.publish.probe_report import effect_table, family_line
from twinrun.publish.render import family_text, interval_text, reading_text, render
from twinrun.publish.sweep import agreement_sentence


def _cell(sigma, p=None, disagree=None, n_seeds=1):
    return {"sigma": sigma, "estimand": "all", "effect_p": p, "effect_F": None if p is None else 1.0,
            "effect_disagree": disagree, "norm_ratio_p": p, "norm_ratio_F": None if p is None else 1.0,
            "norm_ratio_disagree": disagree, "n_seeds": n_seeds}


def test_seeds_with_no_cell_to_test_do_not_agree_they_pool_nothing():
    none = agreement_sentence([_cell(0.2), _cell(0.5)])  # every cell had fewer than two seeds with a number
    assert "agree" not in none and none.startswith("No σ and estimand had two seeds with a number")
    assert "nothing to pool" in none
    some = agreement_sentence([_cell(0.2, p=0.4, disagree=False, n_seeds=2), _cell(0.5)])
    assert "at the 1 of 2 σ × estimand cells" in some and "every σ" not in some
    every = agreement_sentence([_cell(0.2, p=0.4, disagree=False, n_seeds=2)])
    assert every == "The seeds agree within their SEs at every σ and estimand."
    bad = agreement_sentence([_cell(0.2, p=1e-4, disagree=True, n_seeds=3), _cell(0.5)])
    assert bad.startswith("**Seeds disagree**") and "σ=0.2" in bad


def _effect(sigma, estimand="all", below=False):
    return {"sigma": sigma, "estimand": estimand, "below_noise": below, "gate": False}


def test_an_effect_count_leaves_out_rows_that_print_below_noise():
    effects = [_effect(0.2, below=True), _effect(0.5), _effect(1.2, below=True), _effect(2.0)]
    fam = {"n_rows": 4, "n_hypotheses": 4, "level": 0.05, "effect": True,
           "rejected": [{"sigma": s, "estimand": "all"} for s in (0.2, 0.5, 1.2)]}
    text = family_text(fam, effects)
    assert "an effect in 1 row with a number (σ=0.5 all)" in text
    assert "2 below-noise rows reject no effect too (σ=0.2 all, σ=1.2 all)" in text
    assert "an effect in 3 rows" not in text
    only_below = family_text({**fam, "rejected": [{"sigma": 0.2, "estimand": "all"}]}, effects)
    assert "an effect in 0 rows with a number;" in only_below and "1 below-noise row reject" in only_below
    none = family_text({**fam, "effect": False, "rejected": []}, effects)
    assert none.endswith("no row shows an effect.")
    assert family_line({"family": fam, "effects": effects}) == [text]


def _printed(cos_interval, ratio_interval):
    return {"sigma": 0.5, "estimand": "all", "below_noise": False, "gate": False, "cos": 0.23, "se": 0.08,
            "norm_ratio": 1.1, "norm_ratio_se": 0.2, "cos_interval": cos_interval,
            "norm_ratio_interval": ratio_interval, "near_boundary": True, "cos_naive": 0.2, "norm2": 1.0,
            "norm2_se": 0.5, "norm2_base": 1.0, "norm2_base_se": 0.5, "t_crit": 2.0}


def test_an_interval_bounded_on_neither_side_says_why():
    assert interval_text([0.1, 0.3]) == "[0.1000, 0.3000]"  # bounded: no reason needed
    assert interval_text([None, 0.3]) == "[—, 0.3000]"
    both = interval_text([None, None])
    assert both.startswith("[—, —] (unbounded:") and "every value from −1 to 1" in both
    table = "\n".join(effect_table([_printed([None, None], [None, None])]))
    assert "every value from −1 to 1" in table and "every value from 0 to ∞" in table
    summary = {"run_dir": "r", "registered": {}, "checks": [], "gates": [], "used": {"gate_rule": "r"},
               "passed": True, "effects": [_printed([None, None], [0.9, 1.3])]}
    printed = render(summary)
    assert "every value from −1 to 1" in printed and "0 to ∞" not in printed


def _near_row(sigma, twin_z, arm_z=40.0, near=True, ratio=(3.2, None), share=0.2):
    return {"sigma": sigma, "estimand": "all", "below_noise": False, "gate": False, "near_boundary": near,
            "norm2": arm_z, "norm2_se": 1.0, "norm2_base": twin_z, "norm2_base_se": 1.0,
            "cos_interval": [-0.5, -0.2], "norm_ratio_interval": list(ratio), "draw_share": share}


def test_the_reading_names_the_weak_arm_and_claims_only_what_every_near_row_bounds():
    # the default run's shape: the twin barely detected in every row, the ratio bounded below only
    gate = {"sigma": 0.5, "estimand": "all", "below_noise": False, "gate": True}
    rows = [_near_row(0.2, 2.3), _near_row(0.8, 3.9, ratio=(5.0, 13.0), share=0.12), gate]
    text = reading_text(rows)
    assert text.startswith("2 effect rows print a number (besides 1 gate row): 2 of 2 cosine intervals and "
                           "1 of 2 norm-ratio")
    assert "2 of 2 sit near the detection boundary: there the twin's |μ|² is only 2.3–3.9 SE" in text
    assert "at least 3.2× the twin's (the ratio's lower ends); in 1 the data do not bound how much" in text
    assert "In the 2 of them with a pairing receipt the draws carry 12–20% of the twin's noise" in text
    assert "more images would" in text
    # every upper end bounded: no "do not bound" clause
    both = reading_text([_near_row(0.8, 3.9, ratio=(5.0, 13.0))])
    assert "at least 5× the twin's (the ratio's lower ends)." in both and "do not bound" not in both
    # a lower end at or under 1, or open, in any near row bounds no change of size: no "clear" claim
    assert "clear" not in reading_text([_near_row(0.2, 2.3, ratio=(0.9, None)), _near_row(0.8, 3.0)])
    assert "clear" not in reading_text([_near_row(0.2, 2.3, ratio=(None, None)), _near_row(0.8, 3.0)])
    # where the intervention's |μ|² is the weak one, neither the size nor the draws claim (both about the
    # twin) is made
    weak_arm = reading_text([_near_row(0.2, 30.0, arm_z=2.5)])
    assert "the intervention's |μ|² is only 2.5 SE" in weak_arm
    assert "at least" not in weak_arm and "draws" not in weak_arm
    mixed = reading_text([_near_row(0.2, 30.0, arm_z=2.5), _near_row(0.8, 3.0)])
    assert "the weaker arm's (the twin's in 1) |μ|² is only 2.5–3.0 SE" in mixed and "at least" not in mixed
    # where the draws carry a quarter of the noise or more, more draws would help: not said otherwise
    assert "more images" not in reading_text([_near_row(0.2, 2.3, share=0.3), _near_row(0.8, 3.0)])
    assert "In the 1 of them" in reading_text([_near_row(0.2, 2.3, share=None), _near_row(0.8, 3.0)])
    # a row whose SEs are not numbers says nothing of SEs (no "inf SE" or "nan SE")
    odd = reading_text([{**_near_row(0.2, 2.3), "norm2_base_se": 0.0}])
    assert "SE" not in odd and "near" not in odd
    # far from the boundary: counts only
    far = reading_text([_near_row(0.2, 30.0, near=False, ratio=(5.0, 9.0))])
    assert far == ("1 effect row prints a number: 1 of 1 cosine intervals and 1 of 1 norm-ratio intervals "
                   "are bounded on both sides.")
    assert reading_text([{**_near_row(0.2, 1.0), "below_noise": True}, gate]) is None
