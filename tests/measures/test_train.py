"""Twin training runs (measure=train): each rule proved by breaking it.

The streams: a step's samples and noise do not depend on how the batch is cut (a layout-dependent
order is caught). The gate: an intervention off by one ulp at its no-op setting fails it on a
deterministic path. The chaos arm: its perturbation lands before the first segment ends. A resume:
bit-identical to the uninterrupted run (here in-process; kill -9 in test_train_faults.py). Bad input:
one line naming the key, before any compute.
"""

import json
import math
import os
import stat
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from train_runs import compose_cfg, tiny_cfg, train_run

from twinrun.analysis.train_effects import effect_rows, verdict
from twinrun.analysis.train_reduce import Run, compare_stores, first_difference, gate_rows, reduce_train
from twinrun.errors import ConfigError, DeviceMemoryError, TwinrunError
from twinrun.job import run_job
from twinrun.measures import train as train_kind
from twinrun.measures import train_session, train_state
from twinrun.measures import train_streams as streams
from twinrun.measures.registry import load_index
from twinrun.measures.train_step import NonFiniteLoss
from twinrun.plan import plan_run, trusted_targets
from twinrun.publish import publish, table, trackers
from twinrun.storage.rundir import RunIndex
from twinrun.storage.train_store import read_train_store


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One tiny scale_lr run, shared by the tests that only read it."""
    return train_run(tmp_path_factory.mktemp("tiny") / "run")


# ----------------------------------------------------------------------------- the streams


def order_is_layout_free(positions) -> None:
    """The rule: the j-th sample of a step is the same whatever the batch size (a prefix of one keyed
    order), and every sample's noise is a function of (seed, step, sample id) alone."""
    for step in (1, 7):
        big = positions(0, step, 100, 32)
        for batch in (1, 5, 16):
            assert np.array_equal(positions(0, step, 100, batch), big[:batch]), f"step {step}, batch {batch}"
    seg = streams.draw_segment(0, [3], list(range(100, 200)), 8, (1, 2, 2))
    for j, pos in enumerate(seg.positions[0].tolist()):
        normal, eps = streams.sample_noise(0, 3, 100 + pos, (1, 2, 2))
        assert seg.normal[0, j] == normal and np.array_equal(seg.eps[0, j].numpy(), eps)


def test_a_steps_samples_and_noise_do_not_depend_on_the_batch_layout():
    order_is_layout_free(streams.step_positions)


def test_a_layout_dependent_order_is_caught():
    def by_layout(seed, step, n_train, batch_size):  # keyed by the batch size too: the forbidden pattern
        return streams.fresh(streams._ORDER, seed, step, batch_size).permutation(n_train)[:batch_size]

    with pytest.raises(AssertionError, match="batch"):
        order_is_layout_free(by_layout)


def test_a_rekeyed_generator_draws_what_a_fresh_one_does():
    keyed = streams.Keyed()
    for coords in [(0, 1, 5), (3, 2, 7), (0, 1, 5)]:
        a, b = keyed(streams._NOISE, *coords), streams.fresh(streams._NOISE, *coords)
        drawn = [g.standard_normal(65, dtype=np.float32) for g in (a, b)]
        assert np.array_equal(*drawn)
        assert np.array_equal(a.permutation(50), b.permutation(50))


def test_streams_differ_by_seed_and_step_and_never_repeat_a_sample_within_a_step():
    a = streams.step_positions(0, 1, 1500, 64)
    assert len(set(a.tolist())) == 64
    assert not np.array_equal(a, streams.step_positions(0, 2, 1500, 64))
    assert not np.array_equal(a, streams.step_positions(1, 1, 1500, 64))


@pytest.mark.slow
def test_chunking_a_batch_changes_the_arithmetic_never_the_samples(tmp_path):
    whole = train_run(tmp_path / "whole")
    chunked = train_run(tmp_path / "chunked", ["train.chunk_samples=4"])
    stores = {}
    for name, red in (("whole", whole), ("chunked", chunked)):
        index = red.index
        stores[name] = [read_train_store(index.store_path(u, "native"), u["stores"]["native"]["sha256"])
                        for u in index.units]
    for a, b in zip(stores["whole"], stores["chunked"], strict=True):
        assert a.meta["data_digest"] == b.meta["data_digest"]  # the same samples and noise every step
    # Another summation order is a wobble the size of the chaos arm's: small beside the update, not zero.
    rows = compare_stores({i: s for i, s in enumerate(stores["whole"])},
                          {i: s for i, s in enumerate(stores["chunked"])})
    assert rows[-1]["n_differ"] > 0 and 0 < rows[-1]["distance"] < 0.05, rows[-1]
    # chunking moves the arithmetic: it is on the kernel path, so the two runs never compare as one
    kp = [s[-1].meta["kernel_path"]["train"] for s in stores.values()]
    assert kp[0]["chunk_samples"] == -1 and kp[1]["chunk_samples"] == 4


# ----------------------------------------------------------------------------- arms, gate, floor


def test_arms_are_derived_and_the_machinery_gate_passes_bit_identical(tiny):
    red = tiny
    s = red.summary
    assert s["passed"] and s["checks_passed"], s["checks"]
    roles = {a["name"]: a["role"] for a in red.index.arms}
    assert roles == {"scale_lr": "intervention", "native": "twin", "native_replicate": "replicate",
                     "scale_lr_noop": "machinery", "native_chaos": "chaos", "native_chaos_2": "chaos"}
    assert [g["step"] for g in s["gates"]] == [0, 2, 4]
    assert all(g["bit_identical"] and g["rule"] == "bit-identical" for g in s["gates"])
    assert s["replicate"]["deterministic"] and all(r["n_differ"] == 0 for r in s["replicate"]["steps"])
    firsts = {f["arm"]: f for f in s["first_differing"]}
    assert firsts["native_replicate"]["step"] is None and firsts["scale_lr_noop"]["step"] is None
    assert firsts["scale_lr"]["step"] == 1  # the intervention acts from its first step


def test_each_chaos_arm_moves_every_nonzero_weight_by_one_ulp_with_its_own_coins(tiny):
    red = tiny
    firsts = {f["arm"]: f for f in red.summary["first_differing"]}
    start = {a: read_train_store(red.index.store_path(red.index.units[0], a))
             for a in ("native", "native_chaos", "native_chaos_2")}
    weights = [k for k in start["native"].tensors if k.startswith("weight/")]
    ups = []
    for arm in ("native_chaos", "native_chaos_2"):
        assert firsts[arm]["step"] == 0 and firsts[arm]["n_differ"] == len(weights)
        up = []
        for k in weights:
            twin, mine = start["native"].tensors[k], start[arm].tensors[k]
            one_up, one_down = (torch.nextafter(twin, torch.full_like(twin, v))
                                for v in (math.inf, -math.inf))
            moved_once = (mine == one_up) | (mine == one_down)
            assert bool(torch.where(twin == 0, mine == 0, moved_once).all()), (arm, k)  # a zero stays zero
            up.append((mine > twin).flatten())
        ups.append(torch.cat(up).float())
    assert 0.45 < float(ups[0].mean()) < 0.55  # fair coins ...
    assert 0.45 < float((ups[0] == ups[1]).float().mean()) < 0.55  # ... and each arm its own
    check = next(c for c in red.summary["checks"] if c["name"] == "chaos_perturbation_landed")
    assert check["passed"] and "every nonzero element of every trained weight" in check["detail"]
    # the floor is the larger chaos arm's distance, the margin the base times the arms' spread
    for f in red.summary["floor"]:
        assert f["distance"] == max(f["chaos_distances"]) > 0
        assert f["spread"] == pytest.approx(max(f["chaos_distances"]) / min(f["chaos_distances"]))
        assert f["margin"] == pytest.approx(10 * f["spread"])


def test_one_element_chaos_lands_before_the_first_segment_ends(tmp_path):
    red = train_run(tmp_path / "run", ONE_ELEMENT)
    chaos = next(f for f in red.summary["first_differing"] if f["arm"] == "native_chaos")
    assert chaos["step"] == 0 and chaos["first_tensor"] == "blocks.0.attn.qkv.weight"
    assert chaos["n_differ"] == 1  # one weight, one ulp
    first_segment = red.index.units[1]
    start = read_train_store(red.index.store_path(red.index.units[0], "native_chaos"))
    twin0 = read_train_store(red.index.store_path(red.index.units[0], "native"))
    name = "weight/blocks.0.attn.qkv.weight"
    moved = (start.tensors[name] != twin0.tensors[name]).nonzero()
    assert moved.tolist() == [[0, 0]]
    assert float(start.tensors[name][0, 0]) == float(torch.nextafter(twin0.tensors[name][0, 0],
                                                                     torch.tensor(math.inf)))
    # ...and it reaches the training: by the first segment's end every weight has left the twin's bits
    seg = {a: read_train_store(red.index.store_path(first_segment, a)) for a in ("native", "native_chaos")}
    differ = [k for k in seg["native"].digests if k.startswith("weight/")
              and seg["native"].digests[k] != seg["native_chaos"].digests[k]]
    assert len(differ) > 1
    assert red.summary["floor"] and all(f["distance"] > 0 and f["spread"] == 1 for f in red.summary["floor"])


def test_a_lost_perturbation_is_caught(tmp_path, monkeypatch):
    # Break it: the chaos arms' ulps applied to a copy of the weights, never to the model.
    monkeypatch.setattr(train_session, "perturb_every", lambda model, *a: None)
    red = train_run(tmp_path / "run")
    chaos = next(f for f in red.summary["first_differing"] if f["arm"] == "native_chaos")
    assert chaos["step"] is None  # what the chaos test above refuses
    check = next(c for c in red.summary["checks"] if c["name"] == "chaos_perturbation_landed")
    assert not check["passed"] and "no weight" in check["detail"]
    assert not red.summary["passed"] and red.summary["floor"] == [] and red.exit_code == 1


OFF_BY_ONE_ULP = textwrap.dedent("""
    import numpy as np
    from twinrun.interventions import ScaleLR, WeightSigma

    def ulp_up(x):
        return float(np.nextafter(np.float32(x), np.float32(np.inf)))

    class LrOffByOneUlp(ScaleLR):
        '''Its no-op setting (factor 1) trains at one float32 ulp above the optimizer's rate.'''
        def train_lr(self, lr):
            return ulp_up(lr) if self.factor == 1 else lr * self.factor

    class WeightOffByOneUlp(WeightSigma):
        '''Its no-op setting (power 0) weights every sample's loss by 1 + one ulp.'''
        def loss_weight(self, sigma, sigma_data):
            w = (sigma / sigma_data) ** self.power
            return w * ulp_up(1.0) if self.power == 0 else w
""")


@pytest.mark.parametrize("experiment,target", [("train_scale_lr", "LrOffByOneUlp"),
                                               ("train_weight_sigma", "WeightOffByOneUlp")])
def test_an_intervention_off_by_one_ulp_at_its_no_op_fails_the_gate(tmp_path, monkeypatch,
                                                                     experiment, target):
    (tmp_path / "ulp_interventions.py").write_text(OFF_BY_ONE_ULP)
    monkeypatch.syspath_prepend(str(tmp_path))
    red = train_run(tmp_path / "run", [f"intervention._target_=ulp_interventions.{target}"], experiment)
    s = red.summary
    assert s["replicate"]["deterministic"]
    failed = [g for g in s["gates"] if not g["passed"]]
    assert failed and failed[0]["step"] == 2 and failed[0]["rule"] == "not a no-op on a deterministic path"
    assert "not a no-op" in failed[0]["detail"] and failed[0]["first_tensor"]
    assert not s["passed"] and s["effects"] == [] and "INSTRUMENT BROKEN" in s["verdict"]
    assert red.exit_code == 1
    sys.modules.pop("ulp_interventions", None)


def test_a_resume_from_any_whole_segment_is_bit_identical(tmp_path, tiny):
    # Interrupt after the first segment: its later units are forgotten; the job restores every arm
    # (weights and optimizer state) from the first segment's stores and trains on.
    ref = tiny
    run_dir = tmp_path / "run"
    cfg = tiny_cfg()
    plan_run(cfg, run_dir)
    run_job(run_dir, trusted_targets(cfg))
    run = json.loads((run_dir / "run.json").read_text())
    for entry in run["units"][2]["stores"].values():
        entry.update(status="pending", sha256=None)
    (run_dir / "run.json").write_text(json.dumps(run))
    run_job(run_dir, trusted_targets(cfg))
    mine, theirs = RunIndex.load(run_dir), ref.index
    for arm in mine.arm_names:
        a = read_train_store(mine.store_path(mine.units[-1], arm)).digests
        b = read_train_store(theirs.store_path(theirs.units[-1], arm)).digests
        assert a == b, arm


@pytest.mark.parametrize("optimizer", ["torch.optim.AdamW", "torch.optim.SGD"])
def test_optimizer_state_round_trips_through_a_store_bit_for_bit(optimizer):
    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
        node = {"_target_": optimizer, "lr": 0.1, **({"momentum": 0.9} if optimizer.endswith("SGD") else {})}
        return model, train_state.build_optimizer(node, model, train_kind.Intervention())

    def step(model, opt):
        opt.zero_grad()
        model(torch.ones(2, 4)).square().sum().backward()
        opt.step()

    a, opt_a = fresh()
    step(a, opt_a)
    tensors, meta = train_state.optimizer_record(opt_a, train_state.model_names(a))
    b, opt_b = fresh()
    b.load_state_dict(a.state_dict())
    train_state.restore_optimizer(opt_b, train_state.model_names(b), tensors, {"optimizer": meta})
    step(a, opt_a)
    step(b, opt_b)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


# ----------------------------------------------------------------------------- bad input, before compute


def write_mismatched_checkpoint(path) -> str:
    from twinrun.model import DEFAULT_ARCH, DiTDenoiser, save_pretrained

    save_pretrained(DiTDenoiser(**{**DEFAULT_ARCH, "width": 16}), path)
    return str(path)


ONE_ELEMENT = ["train.chaos.weights=one", "train.chaos.arms=1"]


@pytest.mark.parametrize("override,key", [
    (["train.steps=0"], "train.steps"),
    (["train.steps=10", "train.segment_steps=3"], "train.segment_steps"),
    (["train.optimizer.lr=0"], "train.optimizer.lr"),
    (["train.optimizer.lr=-1e-3"], "train.optimizer.lr"),
    (["train.batch_size=5000"], "train.batch_size"),
    (["train.chunk_samples=0"], "train.chunk_samples"),
    (["train.chaos.ulps=0"], "train.chaos.ulps"),
    (["train.optimizer._target_=torch.optim.Nope"], "train.optimizer._target_"),
    (["train/optimizer=sgd", "train.optimizer.momentum=0", "+train.optimizer.nesterov=true"],
     "train.optimizer._target_"),
    ([*ONE_ELEMENT, "train.chaos.param=blocks.9.nope"], "train.chaos.param"),
    ([*ONE_ELEMENT, "train.chaos.index=99999999"], "train.chaos.index"),
    (["train.chaos.weights=some"], "train.chaos.weights"),
    (["train.chaos.arms=0"], "train.chaos.arms"),
    (["train.floor_scope=weights"], "train.floor_scope"),
    (["train.chaos.weights=one"], "train.chaos.arms"),
    # under weights=every each element moves by a seeded coin: a one-element setting would be ignored
    (["train.chaos.param=blocks.1.mlp.0.weight"], "train.chaos.param"),
    (["train.chaos.index=7"], "train.chaos.index"),
    (["train.chaos.ulps=-1"], "train.chaos.ulps"),
    (["intervention.factor=1"], "intervention(ScaleLR)"),
    (["intervention=pin_sigma"], "intervention(PinSigma)"),
    (["reduce.estimands=[all,residual]"], "reduce.estimands"),
    (["train.start_checkpoint=MISMATCHED"], "train.start_checkpoint"),
])
def test_bad_input_is_one_error_naming_the_key_before_compute(tmp_path, override, key):
    override = [o.replace("MISMATCHED", write_mismatched_checkpoint(tmp_path / "w16.safetensors"))
                for o in override]
    with pytest.raises(ConfigError) as err:
        plan_run(tiny_cfg(override), tmp_path / "run")
    assert str(err.value).startswith(f"{key}=") and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_group_matching_no_parameter_names_the_pattern_not_the_probes_setting(tmp_path):
    # a training run compares every parameter of the model: there is no probe.params to fix
    with pytest.raises(ConfigError) as err:
        plan_run(tiny_cfg(['reduce.groups={nothing:["no_such_layer.*"]}']), tmp_path / "run")
    assert str(err.value).startswith("reduce.groups.nothing=") and "probe." not in str(err.value), err.value


def test_another_optimizer_is_a_config_choice(tmp_path):
    red = train_run(tmp_path / "run", ["train/optimizer=sgd"])
    store = read_train_store(red.index.store_path(red.index.units[-1], "native"))
    assert store.meta["optimizer"]["class"] == "torch.optim.sgd.SGD"
    assert any(k.endswith("/momentum_buffer") for k in store.tensors) and red.summary["passed"]


def test_determinism_off_is_allowed_and_the_replicate_reads_the_path(tmp_path):
    red = train_run(tmp_path / "run", ["determinism.enabled=false"])
    job = json.loads((tmp_path / "run" / "env" / "job000.json").read_text())
    assert job["determinism"]["enabled"] is False
    # on this CPU the kernels repeat anyway: the replicate says so (on a GPU with atomics it would not)
    assert red.summary["replicate"]["deterministic"] and red.summary["passed"]


def test_split_bins_is_refused_for_segments():
    from twinrun.pipeline import check_launcher

    with pytest.raises(ConfigError, match=r"^launcher.split='bins': the run's segments are sequ"):
        check_launcher(tiny_cfg(["launcher=submitit_local", "launcher.split=bins"]))


def test_the_probe_refuses_a_training_intervention():
    with pytest.raises(ConfigError, match="no-op everywhere"):
        plan_run(compose_cfg(["+experiment=pin_sigma", "intervention=scale_lr"]), None, dry_run=True)


NAN_LATE = textwrap.dedent("""
    import torch
    from twinrun.interventions import WeightSigma

    class NanLate(WeightSigma):
        '''A loss weight that turns NaN at each arm's third step (the second segment's first).'''
        def loss_weight(self, sigma, sigma_data):
            self.calls = getattr(self, "calls", 0) + 1
            w = (sigma / sigma_data) ** self.power
            return w * float('nan') if self.calls > 2 else w
""")


def test_a_nan_loss_stops_naming_arm_step_and_segment_and_keeps_earlier_ones(tmp_path, monkeypatch):
    (tmp_path / "nan_late.py").write_text(NAN_LATE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny_cfg(["intervention._target_=nan_late.NanLate"], "train_weight_sigma")
    plan_run(cfg, tmp_path / "run")
    with pytest.raises(NonFiniteLoss) as err:
        run_job(tmp_path / "run", trusted_targets(cfg))
    assert err.value.exit_code == 1
    assert str(err.value).startswith("arm weight_sigma, segment 2 (steps 3–4): the training loss is NaN or "
                                     "inf at step 3")
    index = RunIndex.load(tmp_path / "run")
    assert index.status == "failed" and index.failure["arm"] == "weight_sigma"
    for u in index.units[:2]:  # the start and the first segment are whole and verify
        for arm, entry in u["stores"].items():
            read_train_store(index.store_path(u, arm), entry["sha256"])
    sys.modules.pop("nan_late", None)


def test_a_training_store_that_was_altered_is_refused(tiny, tmp_path):
    red = tiny
    u = red.index.units[1]
    path = red.index.store_path(u, "native")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor's payload
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(TwinrunError, match="does not match its sha256"):
        read_train_store(bad)
    with pytest.raises(TwinrunError, match="sha256 does not match run.json"):
        read_train_store(bad, u["stores"]["native"]["sha256"])


def test_on_a_nondeterministic_path_the_replicates_spread_decides_the_gate():
    # Synthetic records: the replicates differ from the twin (the path is nondeterministic), so the
    # machinery arm passes only within the bound of their spread; one replicate bounds nothing.
    def store(last: str) -> dict:
        return {"to_step": 2, "from_step": 0, "step_digests": [["a"], [last]], "digests": {"weight/w": last}}

    reps = {"native_replicate": 1.0e-3, "native_replicate_2": 1.2e-3, "native_replicate_3": 0.9e-3}
    records = [{"native": store("b"), "x_noop": store("d"), **{r: store(r) for r in reps}}]
    index = SimpleNamespace(units=[{"label": "segment 1 (steps 1–2)"}])
    roles = {"machinery": "x_noop", "replicate": "native_replicate"}
    run = Run(index, roles, [{"name": "w"}], 10.0, [], "w", {},
              {"machinery": ["x_noop"], "replicate": list(reps)})
    for machinery, passed, rule in ((1.1e-3, True, "within the path's wobble"),
                                    (1e-2, False, "beyond the path's wobble")):
        found = {(0, "x_noop", "all"): {"distance": machinery, "abs_distance": 1.0},
                 **{(0, r, "all"): {"distance": d, "abs_distance": 1.0} for r, d in reps.items()}}
        row = gate_rows(run, records, found, "replicate")[0]
        assert (row["passed"], row["rule"], row["first_tensor"]) == (passed, rule, "w (after step 2)")
        assert row["replicate_distances"] == list(reps.values()) and row["wobble_bound"] > 1.2e-3
        assert not gate_rows(run, records, found, "bit_identical")[0]["passed"]
        one = Run(index, roles, [{"name": "w"}], 10.0, [], "w", {})  # the first replicate only
        assert gate_rows(one, records, found, "replicate")[0]["rule"] == ("too few replicates differ to "
                                                                          "bound the path's wobble")


def test_a_no_op_that_moves_only_a_buffer_fails_the_gate():
    # Every weight bit-identical after every step, a BatchNorm running mean moved: not a no-op.
    def store(buf: str) -> dict:
        return {"to_step": 2, "from_step": 0, "step_digests": [["a"], ["b"]],
                "digests": {"weight/w": "b", "buffer/bn.running_mean": buf}}

    records = [{"native": store("x"), "native_replicate": store("x"), "x_noop": store("y")}]
    index = SimpleNamespace(units=[{"label": "segment 1 (steps 1–2)"}])
    run = Run(index, {"machinery": "x_noop", "replicate": "native_replicate"}, [{"name": "w"}], 10.0, [],
              "w", {})
    found = {(0, "x_noop", "all"): {"distance": 0.0, "abs_distance": 0.0}}
    row = gate_rows(run, records, found, "replicate")[0]
    assert not row["passed"] and row["rule"] == "not a no-op on a deterministic path"
    assert row["first_tensor"] == "buffer/bn.running_mean"


def test_a_frozen_weight_that_leaves_the_twin_is_found_at_its_segments_last_step():
    # Synthetic records: weight f frozen (blank before the segment's last step), w trained and equal.
    def store(f_last: str) -> dict:
        return {"from_step": 2, "to_step": 5, "step_digests": [["a", ""], ["b", ""], ["c", f_last]]}

    start = {"from_step": 0, "to_step": 0, "digests": {"weight/w": "0", "weight/f": "1"}}
    layout = [{"name": "w"}, {"name": "f"}]
    stores = [{"native": start, "x_noop": start}, {"native": store("f0"), "x_noop": store("f1")}]
    assert first_difference(stores, "x_noop", layout)["step"] == 5  # after step 5, not before
    assert first_difference(stores, "x_noop", layout)["first_tensor"] == "f"
    stores[1]["x_noop"] = store("f0")
    assert first_difference(stores, "x_noop", layout)["step"] is None


LEAK_INTO_FROZEN = textwrap.dedent("""
    import torch
    from twinrun.interventions import ScaleLR

    class LeakIntoFrozen(ScaleLR):
        # At its no-op setting, writes a relative 1e-6 into a frozen weight before a segment's first
        # training forward (not the held-out loss's: a write there is another rule's).
        def attach(self, model):
            if self.factor != 1:
                return []
            weight, done = model.pos_embed, []

            def leak(module, args):
                if module.training and not done:
                    with torch.no_grad():
                        weight.mul_(1 + 1e-6)
                    done.append(True)

            return [model.register_forward_pre_hook(leak)]
""")


def test_a_leak_written_during_the_heldout_loss_fails_the_gate_not_the_stores_checks(tmp_path, monkeypatch):
    """A hook that writes a weight in eval mode (the held-out loss) leaves the store holding what it wrote;
    its last step's digests say so, so the run reads as a failed gate, not as a forged store."""
    # the held-out loss after the first segment's training, not the start's (its store is read whole)
    after_training = "not module.training and getattr(self, 'trained', False)"
    leak = LEAK_INTO_FROZEN.replace("if module.training and not done:", f"if {after_training} and not done:")
    leak = leak.replace("def leak(module, args):\n", "def leak(module, args):\n"
                        "            self.trained = getattr(self, 'trained', False) or module.training\n")
    (tmp_path / "leak_eval.py").write_text(leak)
    monkeypatch.syspath_prepend(str(tmp_path))
    red = train_run(tmp_path / "leak", ["intervention._target_=leak_eval.LeakIntoFrozen"])
    failed = [g for g in red.summary["gates"] if not g["passed"]]
    assert failed and not red.summary["passed"] and "INSTRUMENT BROKEN" in red.summary["verdict"]
    firsts = {f["arm"]: f for f in red.summary["first_differing"]}
    assert firsts["scale_lr_noop"]["step"] == 2 and firsts["scale_lr_noop"]["first_tensor"] == "pos_embed"
    sys.modules.pop("leak_eval", None)


def test_with_frozen_weights_the_gate_still_catches_a_leak_into_one(tmp_path, monkeypatch):
    """Frozen weights are hashed once a segment; a machinery arm that writes into one still fails."""
    frozen = ["train.params=[blocks.*]"]
    red = train_run(tmp_path / "clean", frozen)
    assert red.summary["passed"], red.summary["checks"]
    meta = read_train_store(red.index.store_path(red.index.units[-1], "native")).meta
    blank = [not d for d in meta["step_digests"][0]]
    names = [w["name"] for w in meta["layout"]]
    assert blank == [not n.startswith("blocks.") for n in names] and any(blank) and not all(blank)
    assert all(meta["step_digests"][-1])

    (tmp_path / "leak_frozen.py").write_text(LEAK_INTO_FROZEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    red = train_run(tmp_path / "leak", [*frozen, "intervention._target_=leak_frozen.LeakIntoFrozen"])
    failed = [g for g in red.summary["gates"] if not g["passed"]]
    assert failed and not red.summary["passed"] and "INSTRUMENT BROKEN" in red.summary["verdict"]
    sys.modules.pop("leak_frozen", None)


# ----------------------------------------------------------------------------- where researchers work


def test_a_training_run_is_a_table_and_a_tracker_payload(tiny):
    """The table and the trackers read a training run by its steps (they read σ bins only, and a
    training run raised KeyError in the table and was logged to no tracker)."""
    publish(tiny, train_kind.TRAIN)
    index, summary = tiny.index, tiny.index.run_dir.read_summary()
    rows = table.run_rows(index.run_dir.path, load_index)
    assert len(rows) == len(index.units) * len(summary["used"]["estimands"])
    effects = {(e["step"], e["estimand"]): e for e in summary["effects"]}
    for r in rows:
        assert r["measure"] == "train" and r["gate_passed"] is True
        e = effects.get((r["to_step"], r["estimand"]))
        assert (r.get("cos"), r.get("distance")) == ((None, None) if e is None else (e["cos"], e["distance"]))
    assert any(r.get("cos") is not None for r in rows)
    p = trackers.payload(index, summary, [], train_kind.TRAIN)
    stored = [index.params(u)["to_step"] for u in index.units]
    assert sorted({s["step"] for s in p.steps} - {0}) == stored[1:]  # the gates join the stored steps
    last = max(p.steps, key=lambda s: s["step"])
    assert last["distance/all"] == effects[last["step"], "all"]["distance"]
    # each arm's held-out loss under one key, in the twin's rows and the intervention's
    for rows in (p.baseline_steps, p.arm_steps):
        assert [r["step"] for r in rows if "loss/heldout" in r] == stored
    assert not any(k.startswith("gate/") for k in p.verdict)  # gates are metrics: one per arm, stepped
    assert {(k, s["step"]) for s in p.steps for k in s if k.startswith("gate/")} == {
        (f"gate/{g['arm']}", g["step"]) for g in summary["gates"]}


def test_a_post_hoc_residual_view_of_a_training_run_is_refused(tiny):
    # It read as a plain selection of the weights and printed the `all` numbers labelled `residual`.
    with pytest.raises(ConfigError, match=r"^--estimands=\['residual'\]: \['residual'\] are views over σ"):
        reduce_train(tiny.index.run_dir.path, estimands=["residual"])
    assert not tiny.index.run_dir.view_dir("estimands-residual").exists()


def test_a_post_hoc_family_wise_level_of_a_training_run_is_refused(tiny):
    with pytest.raises(ConfigError, match=r"^--family-alpha=0.01: a training run has no family-wise reading"):
        reduce_train(tiny.index.run_dir.path, family_alpha=0.01)


def test_a_training_store_is_a_safetensors_file_with_the_umasks_mode_and_no_leftover(tiny, tmp_path):
    # safetensors' save_file wrote its own .tmpXXXXXX (never found as a leftover) and left stores 0600,
    # unreadable to anyone else who shares the run directory.
    from safetensors import safe_open

    index = tiny.index
    umask = os.umask(0)
    os.umask(umask)
    for u in index.units:
        for arm in u["stores"]:
            path = index.store_path(u, arm)
            assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
            store = read_train_store(path, u["stores"][arm]["sha256"])
            with safe_open(str(path), framework="pt") as f:  # safetensors' own reader agrees
                assert set(f.keys()) == set(store.tensors)
                assert all(torch.equal(f.get_tensor(k), store.tensors[k]) for k in f.keys())  # noqa: SIM118
    assert not [p for p in index.run_dir.path.rglob(".*tmp*")]


def test_a_resubmitted_training_run_is_held_to_the_launcher_rules_of_its_config(tiny):
    # resume read only probe.compile from the run: a launch.json saying split=bins (or a GPU count its
    # train.device contradicts) was resubmitted without the refusal planning gives.
    from omegaconf import OmegaConf

    from twinrun import launchers
    from twinrun.config import LauncherConfig
    from twinrun.pipeline import _launch_rules

    compiled, sequential, device = _launch_rules(tiny.index.run_dir)
    assert sequential == train_kind.TRAIN.unit_noun and device == ("train.device", "auto")
    launcher = {**OmegaConf.to_container(OmegaConf.structured(LauncherConfig)), "name": "submitit_local",
                "split": "bins"}
    with pytest.raises(ConfigError, match=r"^launcher.split='bins'"):
        launchers.check(launcher, compiled, sequential, device)


def test_running_out_of_memory_while_training_is_the_devices_not_the_models(tmp_path, monkeypatch):
    # It was recorded as the model's exception (exit 4, "resume after fixing it"), not as exit 6.
    real = train_kind.TrainSession._train

    def out_of_memory_in_the_second_segment(self, s, seg, *rest):
        if seg.steps and seg.steps[0] > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return real(self, s, seg, *rest)

    monkeypatch.setattr(train_kind.TrainSession, "_train", out_of_memory_in_the_second_segment)
    cfg, run_dir = tiny_cfg(), tmp_path / "run"
    plan_run(cfg, run_dir)
    with pytest.raises(DeviceMemoryError) as err:
        run_job(run_dir, trusted_targets(cfg))
    assert err.value.exit_code == 6 and "segment 2 (steps 3–4): cpu ran out of memory" in str(err.value)
    index = RunIndex.load(run_dir)
    assert index.failure["error"] == "device_memory" and "type" not in index.failure
    assert [u["index"] for u in index.whole_units()] == [0, 1]  # measured before the error: kept


def test_a_model_without_the_default_chaos_weight_is_told_to_set_train_chaos_param():
    """The default train.chaos.param names the committed DiT's weight: a model of one's own gets one line
    saying so, with names it does have."""
    import torch

    from twinrun.config import ChaosConfig
    from twinrun.measures.train_state import check_chaos

    with pytest.raises(ConfigError) as err:
        check_chaos(torch.nn.Linear(2, 3), ChaosConfig())
    said = str(err.value)
    assert said.startswith("train.chaos.param='blocks.0.attn.qkv.weight': no such parameter in this model "
                           "(the default names the committed DiT's weight") and "\n" not in said
    assert "e.g. weight, bias" in said


def test_the_floor_is_the_largest_chaos_arm_or_replicate_and_the_margin_grows_with_the_spread():
    # Known truth, per estimand: two chaos arms, a replicate, an intervention at known distances.
    def rows(chaos, replicate, effect):
        run = SimpleNamespace(roles={"intervention": "x", "chaos": "native_chaos"}, margin=10.0,
                              floor_scope="estimand",
                              all_of=lambda role: {"chaos": ["native_chaos", "native_chaos_2"],
                                                   "replicate": ["native_replicate"]}.get(role, []))
        found = {(1, "x", "e"): {"distance": effect, "cos": 1.0, "norm_ratio": 1.0},
                 (1, "native_replicate", "e"): {"distance": replicate},
                 **{(1, a, "e"): {"distance": d, "cos": 1.0, "norm_ratio": 1.0}
                    for a, d in zip(("native_chaos", "native_chaos_2"), chaos)}}
        floor, effects = effect_rows(run, [{}, {"native": {"to_step": 2}}], found, ["e"])
        return floor[0], effects[0]

    floor, effect = rows([1e-4, 2e-4], 0.0, 3e-3)  # 15 floors, spread 2: a margin of 20
    assert (floor["distance"], floor["spread"], effect["margin"]) == (2e-4, 2.0, 20.0)
    assert not effect["above_floor"]
    assert rows([2e-4, 2e-4], 0.0, 3e-3)[1]["above_floor"]  # the same 15 floors, chaos that agrees
    # on a nondeterministic path the replicate's wobble beyond the chaos arms' is the floor
    floor, effect = rows([2e-4, 2e-4], 1e-3, 3e-3)
    assert floor["distance"] == 1e-3 and not effect["above_floor"]



def test_with_the_model_scope_an_estimand_is_read_against_the_larger_of_its_floor_and_the_models():
    # Known truth: `cond`'s chaos 1e-5 (spread 1), the model's (`all`) 2.5e-3 (spread 1.2); an effect of
    # 1.4e-3 in `cond` is 140 of its own floors but half the model's: it is not told from chaos.
    chaos = {"all": (2.5e-3, 2.5e-3 / 1.2), "cond": (1e-5, 1e-5)}

    def rows(scope, effect, names=("all", "cond")):
        run = SimpleNamespace(roles={"intervention": "x"}, margin=10.0, floor_scope=scope,
                              all_of=lambda role: {"chaos": ["native_chaos", "native_chaos_2"]}.get(role, []))
        found = {(1, a, n): {"distance": d, "cos": 1.0, "norm_ratio": 1.0} for n, ds in chaos.items()
                 for a, d in zip(("native_chaos", "native_chaos_2"), ds)}
        found |= {(1, "x", n): {"distance": e, "cos": 1.0, "norm_ratio": 1.0} for n, e in effect.items()}
        return {e["estimand"]: e for e in effect_rows(run, [{}, {"native": {"to_step": 2}}], found,
                                                      list(names))[1]}

    small = rows("model", {"all": 1e-3, "cond": 1.4e-3})
    assert not small["cond"]["above_floor"] and small["cond"]["floor"] == 2.5e-3
    assert small["cond"]["margin"] == pytest.approx(12.0)  # the model's spread sets the margin it reads
    assert small["cond"]["floor_from"] == "all" and small["cond"]["own_floor_ratio"] == pytest.approx(140)
    assert "floor_from" not in small["all"]  # the model's own floor: nothing else to say
    assert rows("estimand", {"all": 1e-3, "cond": 1.4e-3})["cond"]["above_floor"]  # its own floor: 140×
    # an effect above the model's floor × margin reads above in every estimand, whatever the scope
    large = rows("model", {"all": 0.14, "cond": 0.15})
    assert large["all"]["above_floor"] and large["cond"]["above_floor"]
    # the model's floor is read even where `all` is not a registered estimand; a larger own floor stays
    assert rows("model", {"cond": 1.4e-3}, names=("cond",))["cond"]["floor"] == 2.5e-3
    # the verdict says whose floor it read, and what moved as far
    said = verdict(list(small.values()), "cond", 10.0)
    assert said.startswith("the intervention CANNOT be told from chaos (cond)")
    assert "the whole model's (`all`: train.floor_scope=model; cond's own 1e-05, 140×)" in said
    assert "a one-ulp wobble moves the whole model (`all`) nearly as far, for its update, as the " \
           "intervention moves cond" in said
    assert "ABOVE" in verdict(list(large.values()), "cond", 10.0)
    chaos["cond"] = (4e-3, 4e-3)
    own = rows("model", {"all": 1e-3, "cond": 1e-2})["cond"]
    assert own["floor"] == 4e-3 and "floor_from" not in own
    # the model's floor is the larger but its bar is not (cond's chaos spread 5×): the model scope never
    # reads an effect its own floor would not
    chaos.update(all=(1.1e-5, 1.1e-5), cond=(1e-5, 2e-6))
    for scope in ("model", "estimand"):
        uneven = rows(scope, {"all": 1e-5, "cond": 3e-4})["cond"]
        assert not uneven["above_floor"] and uneven["margin"] == pytest.approx(50), scope
    # a distance nobody could read (no trained weight in the estimand) gives a sentence, not a traceback
    blank = {**small["cond"], "distance": None, "floor_ratio": None, "own_floor_ratio": None}
    assert "its distance from the twin is –" in verdict([blank], "cond", 10.0)


def test_a_run_says_the_floor_scope_it_read_and_one_planned_before_it_reads_its_own_floors(tiny, tmp_path):
    import yaml

    from twinrun.protocol import config_hash
    from twinrun.publish.train_rows import tracker_rows

    s = tiny.summary
    assert s["floor_scope"] == "model"
    cond = [e for e in s["effects"] if e["estimand"] == "cond"]
    assert cond and all(e["floor_from"] == "all" for e in cond)  # a tiny run's chaos reaches cond least
    rows = tracker_rows(tiny.index, s)[0]
    assert all(r["own_floor/cond"] == e["own_floor"] for r, e in zip(rows, cond, strict=True))
    # A run planned before train.floor_scope existed: its arms' configs lack the key, and it reads each
    # estimand against its own floor, as it did then.
    run_dir = tmp_path / "old"
    cfg = tiny_cfg()
    plan_run(cfg, run_dir)
    run = json.loads((run_dir / "run.json").read_text())
    for arm in run["arms"]:
        path = run_dir / "arms" / arm["name"] / "config.yaml"
        config = yaml.safe_load(path.read_text())
        del config["train"]["floor_scope"]
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        arm["config_hash"] = config_hash(config)
    (run_dir / "run.json").write_text(json.dumps(run))
    run_job(run_dir, trusted_targets(cfg))
    old = reduce_train(run_dir).summary
    assert old["floor_scope"] == "estimand" and not any("floor_from" in e for e in old["effects"])
    # the same stores read under the model's floor would not: the scope is what differs
    assert any(e["floor"] != o["floor"] for e, o in zip(s["effects"], old["effects"], strict=True)
               if e["estimand"] == "cond")
