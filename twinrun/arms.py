"""Arms: the user's intervention arm and the native twin twinrun derives from it.

The twin is the same config with only the `intervention` node replaced by `native`; both are
resolved, and if their difference reaches outside `intervention` (an interpolation that reads
the intervention, say), the pair is not a twin and the run is refused before any compute.
"""

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from twinrun.errors import TwinrunError
from twinrun.files import SAFE_NAME

INTERVENTION_KEY = "intervention"
NATIVE = {"_target_": "twinrun.interventions.Native"}
# How a run is launched, where it is also logged, and what it is later compared with, do not enter its
# result.
EXCLUDED = ("hydra", "launcher", "tracker", "reference")


class NotATwin(TwinrunError):
    pass


@dataclass
class Arm:
    name: str  # directory under RUN_DIR/arms/
    config: dict  # resolved, plain containers
    role: str  # "intervention" | "twin" | "replicate" | "machinery" | "chaos"


def _resolved(cfg: DictConfig, what: str) -> dict:
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as err:
        msg = str(err).splitlines()[0]
        raise NotATwin(f"the {what} config does not resolve ({msg}); a value outside "
                       "`intervention` must not depend on the intervention") from None


def twin_of(cfg: DictConfig) -> DictConfig:
    """The same config with the intervention replaced by the native one (same seed, all else)."""
    twin = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    twin[INTERVENTION_KEY] = dict(NATIVE)
    return twin


def flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def config_diff(a: dict, b: dict) -> list[dict]:
    """Leaf-level differences between two resolved configs: [{key, a, b}], sorted by key."""
    fa, fb = flatten(a), flatten(b)
    keys = sorted(set(fa) | set(fb))
    return [{"key": k, "a": fa.get(k), "b": fb.get(k)} for k in keys if fa.get(k, ...) != fb.get(k, ...)]


def outside_intervention(diff: list[dict]) -> list[str]:
    return [d["key"] for d in diff if d["key"].split(".")[0] != INTERVENTION_KEY]


def for_compute(cfg: dict, exclude: tuple = ()) -> dict:
    """The part of a resolved config that can change a result (launching excluded, and `exclude`: the
    settings of the measurement kinds this run is not). An unset arms.replicates or arms.replicate_segments
    is left out: runs planned before they existed keep their config hashes."""
    out = {k: v for k, v in cfg.items() if k not in EXCLUDED and k not in exclude}
    if isinstance(out.get("arms"), dict):
        out["arms"] = {k: v for k, v in out["arms"].items()
                       if k not in ("replicates", "replicate_segments") or v is not None}
    return out


def replicate_name(k: int) -> str:
    """The k-th replicate's arm (k from 1): native_replicate, native_replicate_2, …"""
    return "native_replicate" if k == 1 else f"native_replicate_{k}"


def chaos_name(k: int) -> str:
    """The k-th chaos arm (k from 1): native_chaos, native_chaos_2, …"""
    return "native_chaos" if k == 1 else f"native_chaos_{k}"


def chaos_number(name: str) -> int:
    """k of the arm chaos_name(k) names (its coins' draw)."""
    return 1 if name == "native_chaos" else int(name.rsplit("_", 1)[1])


def machinery_of(cfg: DictConfig, noop: dict) -> DictConfig:
    """The same config with the intervention at its no-op setting: its own code, doing nothing."""
    machinery = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for key, value in noop.items():
        machinery[INTERVENTION_KEY][key] = value
    return machinery


def derive_arms(cfg: DictConfig, intervention_name: str, replicate: bool = False,
                noop: dict | None = None, chaos: int = 0,
                exclude: tuple = (), replicates: int = 1) -> tuple[list[Arm], list[dict]]:
    """[intervention, twin(, replicates)(, machinery)(, chaos)] and the intervention–twin diff; refuse a
    pair that is not a twin. `replicate`: the twin's replicate is an arm (`replicates` of them; without
    `replicate`, replicates beyond the first, which the probe measures at its gate bins only, are arms);
    `noop`: the intervention's no-op setting, which adds its machinery arm;
    `chaos`: how many chaos arms, each the twin once more run with a one-ulp perturbation (a training
    run's floor: its config is the twin's, its role and name say what differs); `exclude`: config keys
    no arm carries."""
    if cfg[INTERVENTION_KEY].get("_target_") == NATIVE["_target_"]:
        raise TwinrunError(
            "intervention=native: no intervention declared; declare one, e.g. "
            "`python -m twinrun +experiment=pin_sigma` (twinrun derives the native twin itself)"
        )
    if not isinstance(intervention_name, str) or not SAFE_NAME.fullmatch(intervention_name) \
            or ".." in intervention_name:
        raise TwinrunError(
            f"intervention._target_={cfg[INTERVENTION_KEY].get('_target_')}: its name {intervention_name!r} "
            "names its arm directory, so it must be letters, digits, '_', '.', '-' without '..'"
        )
    if intervention_name == "native" or intervention_name.startswith(("native_replicate", "native_chaos")):
        raise TwinrunError(
            f"intervention._target_={cfg[INTERVENTION_KEY].get('_target_')}: its name {intervention_name!r} "
            "is the twin's own; give the intervention class another `name` (its arm directory)"
        )
    mine = for_compute(_resolved(cfg, "intervention arm's"), exclude)
    twin = for_compute(_resolved(twin_of(cfg), "derived twin's"), exclude)
    diff = config_diff(mine, twin)
    bad = outside_intervention(diff)
    if bad:
        raise NotATwin(
            f"the derived twin differs outside `intervention` at {', '.join(bad)}; a twin may "
            "differ only in the intervention: do not let other keys interpolate from it"
        )
    arms = [Arm(intervention_name, mine, "intervention"), Arm("native", twin, "twin")]
    first = 1 if replicate else 2
    arms += [Arm(replicate_name(k), twin, "replicate") for k in range(first, replicates + 1)]
    if noop is not None:
        machinery = for_compute(_resolved(machinery_of(cfg, noop), "machinery arm's"), exclude)
        arms.append(Arm(f"{intervention_name}_noop", machinery, "machinery"))
    arms += [Arm(chaos_name(k), twin, "chaos") for k in range(1, int(chaos) + 1)]
    return arms, diff
