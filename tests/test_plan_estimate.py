"""Planning refuses before any compute what could never work, in one line naming the key: a run beyond the
memory it will have, an intervention that is no intervention, a compile cache that cannot be created, a
group that matches nothing; and it prints the estimate of time and memory a user reads before the run."""

import re

import pytest
from conftest import TINY

from twinrun.errors import ConfigError
from twinrun.measures import probe_cost
from twinrun.plan import plan_run

NOT_AN_INTERVENTION = '''
class NoNoop:
    """Looks like an intervention, subclasses nothing, has no noop()."""

    name = "no_noop"

    def __init__(self, sigma_pin=0.5):
        self.sigma_pin = sigma_pin

    def sigma_cond(self, sigma):
        return sigma * 0 + self.sigma_pin

    def attach(self, model):
        return []

    def gate_sigmas(self, grid):
        return [s for s in grid if s == self.sigma_pin]

    def check(self, grid):
        pass

    def check_model(self, model):
        pass
'''


def _plan(compose_cfg, *overrides):
    return plan_run(compose_cfg(["+experiment=pin_sigma", *TINY, *overrides]), None, dry_run=True)


def test_the_plan_prints_an_estimate_of_time_and_memory(compose_cfg, capsys):
    _plan(compose_cfg, "probe.n_draws=1000000", "probe.chunk_draws=2")
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("twinrun: estimate:"))
    # 7 stores (2 arms x 3 bins, the gate replicate) x 8 images x 10^6 draws, one call timed here
    assert "7 stores x 8,000,000 samples" in line, line
    assert "one probe call of 8 images x 2 draws took" in line, line
    hours = float(re.search(r"\(([\d,.]+) h\)", line).group(1).replace(",", ""))
    seconds = float(re.search(r"about ([\d,]+) s of measuring", line).group(1).replace(",", ""))
    assert hours == pytest.approx(seconds / 3600, abs=0.01) and hours > 1, line  # 56 million samples: hours
    assert "draws of a bin 1.91" in line and "peak host memory about" in line, line  # 8 x 10^6 x 64 x 4 bytes


def test_a_run_beyond_the_memory_it_will_have_is_refused_naming_the_biggest_part(compose_cfg, monkeypatch):
    # the job's own limit (launcher.mem_gb), where one is set: 1 GiB, and a bin's draws alone take 1.9
    with pytest.raises(ConfigError, match=r"probe.n_draws=1000000: the job would need about .* GiB of host "
                                          r"memory \(draws of a bin: 1.9 GiB\), more than the 1.0 GiB of "
                                          r"launcher.mem_gb=1"):
        _plan(compose_cfg, "probe.n_draws=1000000", "probe.chunk_draws=2", "launcher.mem_gb=1")
    monkeypatch.setattr(probe_cost, "memory_bytes", lambda: 2**28)  # else this machine's memory: 256 MiB
    with pytest.raises(ConfigError, match=r"model='twinrun.model.load_pretrained': .*\(the process before "
                                          r"measuring: .*the 0.2 GiB of this machine"):
        _plan(compose_cfg)


def test_an_intervention_class_without_noop_is_refused_at_plan_time_naming_the_method(compose_cfg, tmp_path,
                                                                                       monkeypatch):
    (tmp_path / "byo_noop.py").write_text(NOT_AN_INTERVENTION)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"intervention._target_='byo_noop.NoNoop': built a NoNoop, which "
                                          r"lacks the method noop\(\) of the Intervention protocol"):
        _plan(compose_cfg, "intervention._target_=byo_noop.NoNoop")


def test_a_compile_cache_that_cannot_be_created_is_refused_even_for_root(compose_cfg, tmp_path):
    for bad in ("/proc/twinrun-cache", "/sys/twinrun-cache"):  # os.access says root may write there
        with pytest.raises(ConfigError, match=rf"determinism.compile_cache_dir='{bad}': cannot be created"):
            _plan(compose_cfg, f"determinism.compile_cache_dir={bad}")
    fresh = tmp_path / "a" / "cache"
    _plan(compose_cfg, f"determinism.compile_cache_dir={fresh}")
    assert fresh.is_dir() and not list(fresh.iterdir())  # created, as the job would, and left empty


def test_a_group_that_matches_nothing_is_refused_even_when_no_estimand_names_it(compose_cfg):
    with pytest.raises(ConfigError, match=r"reduce.groups.ghost=\['nothing.\*'\]: matches no probed"):
        _plan(compose_cfg, "+reduce.groups={ghost:[nothing.*]}")
