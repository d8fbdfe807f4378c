"""The reports' sentences claim no more than was measured: each is built here from a summary that would
make its stronger wording false (no seed pair to pool, rejected rows that print below noise, an interval
bounded on neither side) and must say what it can."""

from twinrun.publish.probe_report import effect_table, family_line
from twinrun.publish.render import family_text, interval_text, render
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
