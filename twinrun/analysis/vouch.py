"""One reader standard for every measurement kind: what each store of a run must agree with before any
number is computed from it.

A kind declares its stores' fields (a StoreRules its own reducer hands to Voucher): the metadata field
naming its unit, the fields that equal its unit's own in run.json, those that equal a key of its arm's
config.yaml, those that equal the first store's, and list fields whose length a config key gives.
`Voucher` holds every store of a run to them, and to what every kind shares: its arm and unit, the
config hash of its arm (each config.yaml itself held to run.json's hash, RunIndex.arm_config), the
kernel path run.json records for it, and the data set's ids where the data set is twinrun's own. A store
that disagrees is one StoreError naming the file and the field (exit 2), never a verdict.
"""

from dataclasses import dataclass, field
from pathlib import Path

from twinrun import data as data_mod
from twinrun.config import DigitsDataConfig, DigitsTrainDataConfig
from twinrun.errors import StoreError
from twinrun.storage.rundir import RunIndex

TWIN = "native"


@dataclass(frozen=True)
class StoreRules:
    """What a kind's store metadata must equal (each a metadata field name)."""

    unit_index: str  # the field naming the store's unit (its index in run.json's units)
    unit_fields: dict = field(default_factory=dict)  # field -> the unit's own field (units[i][kind][...])
    config_fields: dict = field(default_factory=dict)  # field -> dotted key of the arm's config.yaml
    shared_fields: tuple = ()  # equal in every store of the run (the first read's)
    lengths: dict = field(default_factory=dict)  # list field -> dotted config key giving its length
    own_ids: tuple | None = None  # (ids field, config key of their count): twinrun's own data set's ids


def at(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def own_ids(config: dict, n: int) -> list[int] | None:
    """The ids twinrun's own data set gives the first `n` held-out (probed) images, recomputed from the
    data set itself; None for a data builder of the user's (reading a run runs nobody else's code)."""
    target = (config.get("data") or {}).get("_target_") if isinstance(config.get("data"), dict) else None
    if target == DigitsDataConfig._target_:
        return [int(i) for i in data_mod.load_heldout_images()[1][:n]]
    if target == DigitsTrainDataConfig._target_:
        return [int(i) for i in data_mod.load_train_and_heldout()[1][1][:n]]
    return None


class Voucher:
    """Every store of one run held to its kind's StoreRules and to the run: `store(u, arm, path, meta)`
    as each is read, before any number is computed from it."""

    def __init__(self, index: RunIndex, rules: StoreRules):
        self.index, self.rules = index, rules
        self.configs = {a["name"]: index.arm_config(a["name"]) for a in index.arms}
        self.hashes = {a["name"]: a["config_hash"] for a in index.arms}
        self.first: dict | None = None
        self._ids: dict = {}

    def store(self, u: dict, arm: str, path: Path, meta: dict) -> None:
        index, rules = self.index, self.rules
        config = self.configs.get(arm, self.configs[TWIN])  # the gate replicate: the twin measured again
        # Identity first (run, arm, unit, kernel path): a store copied in from another run or arm is refused
        # before its fields are compared.
        if meta["config_hash"] != self.hashes.get(arm, self.hashes[TWIN]):
            raise StoreError(path, "config hash differs from run.json's: a store from another run")
        if meta["arm"] != arm or meta[rules.unit_index] != u["index"]:
            raise StoreError(path, f"store belongs to another arm or {rules.unit_index.split('_')[0]} than "
                             "run.json says")
        recorded = index.store_entry(u, arm).get("kernel_path_sha256")
        if recorded != (meta.get("env") or {}).get("kernel_path_sha256"):
            raise StoreError(path, "metadata field env.kernel_path_sha256 is not the kernel path run.json "
                             f"records for it ({recorded}): damaged or forged")
        # The kind's declared fields, each held to what its unit, its config or the first store read says, so
        # one forged field is caught wherever it sits.
        own = index.params(u)
        expected = {k: own.get(v) for k, v in rules.unit_fields.items()}
        expected.update({k: at(config, v) for k, v in rules.config_fields.items()})
        if self.first is None:
            self.first = meta  # the first store read: every other must agree with it on the shared fields
        else:
            expected.update({k: self.first.get(k) for k in rules.shared_fields})
        for key, value in expected.items():
            if meta.get(key) != value:
                raise StoreError(path, f"metadata field {key}: {str(meta.get(key))[:60]} is not "
                                 f"{str(value)[:60]}, what its run measured (its config, its unit, the "
                                 "twin's first store): damaged or forged")
        # Lists whose entries the config does not spell (the images' ids) are held at least to the count it
        # gives.
        for key, dotted in rules.lengths.items():
            if key in meta and len(meta[key] or []) != at(config, dotted):
                raise StoreError(path, f"metadata field {key}: {len(meta[key] or [])} entries, not the "
                                 f"{at(config, dotted)} of its config's {dotted}: damaged or forged")
        self._check_ids(path, meta, config)

    def _check_ids(self, path: Path, meta: dict, config: dict) -> None:
        if self.rules.own_ids is None:
            return
        key, dotted = self.rules.own_ids
        n = at(config, dotted)
        if (key, n) not in self._ids:
            self._ids[key, n] = own_ids(config, n) if isinstance(n, int) else None
        ids = self._ids[key, n]
        if ids is not None and key in meta and meta[key] != ids:
            raise StoreError(path, f"metadata field {key}: {str(meta[key])[:60]} is not {str(ids)[:60]}, "
                             "what its config's data set holds: damaged or forged")


def bit_identical_ends(mine: dict, twin: dict) -> bool:
    """Every tensor a training store holds except its losses (weights, buffers, optimizer state) equals
    the twin's bit for bit."""
    keys = [k for k in twin if k not in ("train_loss", "heldout_loss")]
    return set(mine) == set(twin) and all(mine[k] == twin[k] for k in keys)


def check_step_digests(path: Path, mine: dict, twin: dict, digests: dict, twin_digests: dict,
                       twin_path: Path) -> None:
    """An arm whose stored state is bit-identical to the twin's cannot have parted from it within the
    unit (a trajectory that parts does not come back to the same bits of every weight and every optimizer
    moment): step digests that say otherwise were edited, and would read as a failed gate at distance 0."""
    if mine["step_digests"] != twin["step_digests"] and bit_identical_ends(digests, twin_digests):
        raise StoreError(path, f"metadata field step_digests: differs from the twin's "
                         f"({'/'.join(Path(twin_path).parts[-3:])}) within the unit, but every weight and "
                         "optimizer state it stores is bit-identical to the twin's: one of the two is "
                         "damaged or forged")

