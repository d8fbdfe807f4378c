"""A sweep's planning runs the model's trial (and times its call) once per model and probe settings, not
once per point: the points planned in one process share what the first one found."""

from twinrun.measures import trial

CONFIG = {"model": {"_target_": "m"}, "data": {"n": 1}, "probe": {"method": "auto"},
          "intervention": {"_target_": "twinrun.interventions.PinSigma", "sigma_pin": 0.5}}


def test_the_trial_runs_once_for_points_that_differ_in_a_number_only(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(trial, "PLANNED", {})
    monkeypatch.setattr(trial, "_smoke_test", lambda *a: ran.append(a) or "vmap")

    def plan(config):
        return trial.smoke_test(None, [], type("P", (), {"method": "auto"})(), None, 0.2, {},
                                key=trial.trial_key(config, 0.2, "trial"))

    assert [plan({**CONFIG, "intervention": {**CONFIG["intervention"], "sigma_pin": pin}})
            for pin in (0.2, 0.5, 1.2)] == ["vmap"] * 3
    assert len(ran) == 1
    assert "as the trial run at plan time found for an earlier point" in capsys.readouterr().out
    plan({**CONFIG, "intervention": {"_target_": "twinrun.interventions.ScaleModule", "module": "blocks.1"}})
    plan({**CONFIG, "probe": {"method": "auto", "compile": "default"}})
    assert len(ran) == 3  # another intervention class, other probe settings: a trial of their own
