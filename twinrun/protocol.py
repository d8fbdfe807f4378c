"""What a measurement is, defined once: the protocol keys two runs must share to measure the same thing,
the identity each store records, and an arm's config hash (run.json's record of its resolved config)."""

import hashlib
import json

from twinrun.objectives import EDM_P_MEAN, EDM_P_STD

# What a measurement is, defined once: two runs (a run and its reference) measure the same thing
# only if these keys of their resolved configs are equal. Chunking, device and method change the
# arithmetic, not what is measured (they are in the kernel path instead). The model config is not
# part of it: weights move between paths and machines, and the parameter layout, which is, is
# checked store by store.
PROTOCOL_KEYS = ("data", "objective", "sigma_grid", "seed", "probe.n_images", "probe.n_draws",
                 "probe.n_folds", "probe.params", "probe.train_mode")
# A run recorded before objectives were configurable ran edm with its defaults (conf/objective/edm.yaml).
DEFAULT_OBJECTIVE = {"_target_": "twinrun.objectives.EDM", "p_mean": EDM_P_MEAN, "p_std": EDM_P_STD}
# The same protocol as each store's metadata records it (n_folds and params become the fold sizes
# and the parameter layout): every store of a run must agree on these (checks.py, references.py).
STORE_PROTOCOL_KEYS = ("n_images", "n_draws", "fold_sizes", "layout")
# What was measured, as each store records it: every store of a run must agree on these, and a
# reference whose differ is dead for that reason (the model's or the data's), not the environment's.
STORE_IDENTITY_KEYS = ("model_sha256", "data_sha256", "adapter_sha256")


def config_hash(config: dict) -> str:
    """An arm's resolved config as run.json records it (planning writes it; the job and the reducer check
    each config.yaml against it). The kernel-pin settings left at their defaults are left out, so a
    config from before they existed hashes as it did."""
    det = config.get("determinism") if isinstance(config, dict) else None
    if isinstance(det, dict) and any(det.get(k) in UNSET_PIN.get(k, ()) for k in det):
        config = {**config, "determinism": {k: v for k, v in det.items() if v not in UNSET_PIN.get(k, ())}}
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


# The kernel-pin settings at their defaults, which config_hash leaves out.
UNSET_PIN = {"kernel_path_from": (None,), "cold_check": (False,), "trust_bundle": (False,)}


def _at(config: dict, dotted: str):
    """The value at a dotted key of a plain config (None where any part is missing)."""
    node = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def protocol_differences(a: dict, b: dict, keys=PROTOCOL_KEYS) -> list[str]:
    """The protocol keys at which two resolved configs differ (empty: they measure the same thing)."""
    return [k for k in keys if _protocol_at(a, k) != _protocol_at(b, k)]


def _protocol_at(config: dict, dotted: str):
    value = _at(config, dotted)
    return DEFAULT_OBJECTIVE if dotted == "objective" and value is None else value
