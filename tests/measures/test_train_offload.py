"""Arms parked off the device (train.offload): an arm parked and brought back holds the same bits (weights,
buffers, optimizer state, EMA) and trains on exactly as one that never left; a whole run parked on disk
is bit-identical to the all-resident layout."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from twinrun.analysis.train_reduce import reduce_train
from twinrun.app import CONF_DIR
from twinrun.config import TrainConfig, register_configs
from twinrun.interventions import Native
from twinrun.job import run_job
from twinrun.measures import train_loop as loop
from twinrun.measures.train_offload import Parking
from twinrun.measures.train_state import ArmState
from twinrun.plan import plan_run, trusted_targets
from twinrun.storage.rundir import RunIndex
from twinrun.storage.train_store import read_train_store


def arm(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6))
    model.sigma_data = 0.5
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    t = TrainConfig(batch_size=8, ema=0.9)
    return ArmState(model, opt, Native(), 0, t, None, loop.build_ema(0.9, model), None)


def train(s, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g)
        s.optimizer.zero_grad()
        ((s.model(x) - x) ** 2).mean().backward()
        s.optimizer.step()
        s.ema.update()


def state(s):
    out = {f"m/{k}": v.clone() for k, v in s.model.state_dict().items()}
    out.update({f"o/{i}/{k}": v.clone() for i, st in s.optimizer.state_dict()["state"].items()
                for k, v in st.items()})
    out.update({f"e/{k}": v.clone() for k, v in s.ema.shadow.items()})
    return out


@pytest.mark.parametrize("mode", ["disk"])
def test_a_parked_arm_comes_back_bit_for_bit_and_trains_on_as_if_it_never_left(mode):
    stay, moved = arm(), arm()
    train(stay), train(moved)
    parking = Parking(mode, torch.device("cpu"))
    params = list(moved.model.parameters())
    before = state(moved)
    parking.park(moved)
    assert all(p.numel() == 0 for p in moved.model.parameters()) and not moved.optimizer.state  # off
    parking.unpark(moved)
    assert list(moved.model.parameters()) == params  # the same Parameter objects: the optimizer's
    after = state(moved)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    train(stay), train(moved)
    a, b = state(stay), state(moved)
    assert all(torch.equal(a[k], b[k]) for k in a)
    parking.close()
    assert not parking.dir.exists()


def test_an_arm_no_segment_trains_again_leaves_the_parking_with_its_file():
    # arms.replicate_segments: the replicate stops after K segments; its parked copy must not stay for
    # the rest of the job (host memory under offload=cpu on a GPU, a file under disk).
    gone, stays = arm(), arm()
    parking = Parking("disk", torch.device("cpu"))
    parking.park(gone), parking.park(stays)
    assert len(list(parking.dir.iterdir())) == 2
    parking.drop(gone)
    assert list(parking.held) == [id(stays)] and len(list(parking.dir.iterdir())) == 1
    parking.unpark(stays)  # the other arm's copy is untouched
    assert not list(parking.dir.iterdir())
    parking.close()


def test_host_parking_on_a_cpu_run_is_no_copy_at_all():
    s = arm()
    Parking("cpu", torch.device("cpu")).park(s)
    assert all(p.numel() > 0 for p in s.model.parameters())


TINY = ["+experiment=train_scale_lr", "train.steps=4", "train.segment_steps=2", "train.batch_size=8",
        "train.heldout_images=8", "train.device=cpu", "train.ema=0.9"]


def run(run_dir, extra):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*TINY, *extra])
    plan_run(cfg, run_dir)
    run_job(run_dir, trusted_targets(cfg))
    index = RunIndex.load(run_dir)
    return {(u["index"], a): read_train_store(index.store_path(u, a)).digests
            for u in index.units for a in index.arm_names}


@pytest.mark.slow
def test_a_run_parked_on_disk_is_bit_identical_to_the_all_resident_layout(tmp_path):
    resident = run(tmp_path / "resident", [])
    parked = run(tmp_path / "parked", ["train.offload=disk"])
    assert resident == parked
    # The EMA (train.ema) read as its own estimand: the intervention's EMA against the twin's, the floor.
    ema = reduce_train(tmp_path / "resident").summary["ema"]
    assert [r["step"] for r in ema] == [2, 4] and all(r["distance"] > 0 and r["floor"] > 0 for r in ema)
