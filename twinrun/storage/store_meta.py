"""A store's metadata as types (ProbeStoreMeta, TrainStoreMeta), checked field by field as every document
of the run directory is (twinrun.storage.records), then by the rules across their fields.

A store's metadata is untrusted input like run.json: a field that fails is one line naming the store and the
field (exit 2), never a traceback or a number.
"""

from pathlib import Path
from typing import Annotated, NotRequired, TypedDict

from twinrun.provenance.record import kernel_path_sha256
from twinrun.storage.records import HexDigest
from twinrun.storage.typed import Checker, check_typed, show

StepDigest = Annotated[str, "hex digest or blank"]  # a weight's sha256 prefix after a step; blank: frozen

# ----------------------------------------------------------------------------- store metadata


class LayoutEntry(TypedDict):
    name: str  # the parameter's name in model.named_parameters()
    offset: int  # its first column in the fold sums
    numel: int
    cond: bool  # part of the conditioning pathway


class ProbeStoreMeta(TypedDict):
    """A probe store's metadata (JSON-decoded strings): what reduce, compare and resume read from it."""

    arm: str
    bin_index: int
    sigma: Annotated[float, "positive"]
    sigma_cond: Annotated[float, "positive"]
    n_images: int
    n_draws: int
    fold_sizes: list[int]
    # Each probed image's id in the data set (it keys the image's draws) and the run's seed: the job always
    # writes them; the reducer holds them to the run's config and to each other (twinrun.analysis.checks).
    image_ids: NotRequired[list[int]]
    seed: NotRequired[int]
    draws_digest: str
    config_hash: str
    # The model as built, every parameter and buffer (provenance.record.model_sha256), and the probed
    # images with their ids; absent in stores written before they were recorded.
    model_sha256: NotRequired[HexDigest]
    data_sha256: NotRequired[HexDigest]
    adapter_sha256: NotRequired[HexDigest]  # a LoRA adapter's files (twinrun.lora), where one is loaded
    layout: list[LayoutEntry]
    # The pairing receipt's inputs: the draws in each half [k1, k2] (None for one draw an image) and the
    # base64 float64 [n_tensors, F, F] blocks of S and H (twinrun.analysis.receipts reads them); absent in
    # stores written before them.
    half_draws: NotRequired[list[int] | None]
    pairing: NotRequired[dict[str, str] | None]
    env: NotRequired[dict | None]
    kernel_path: NotRequired[dict | None]


class WeightEntry(TypedDict):
    name: str  # the parameter's name in model.named_parameters()
    shape: list[int]
    cond: bool  # part of the conditioning pathway


class TrainStoreMeta(TypedDict):
    """A training store's metadata (JSON-decoded strings): one arm's state at the end of one unit."""

    arm: str
    unit_index: int
    from_step: int
    to_step: int
    seed: int
    config_hash: str
    layout: list[WeightEntry]  # the weights, in model.named_parameters() order
    optimizer: dict  # its class, param_groups and the state that is not a tensor
    data_digest: str  # sha256 of the samples and noise this unit's steps consumed (equal in every arm)
    heldout_digest: str  # sha256 of the held-out images and noise the held-out loss read
    heldout_ids: NotRequired[list[int]]  # the held-out images' ids (the reducer holds them to the data)
    # per step of the unit, per weight (layout order): sha256 prefix of the weight after that step (the
    # last step's is a prefix of the stored weight's own digest: read_train_store checks it); blank at
    # the steps before the last for a frozen weight, hashed once a segment (train_step.DigestsMeanwhile)
    step_digests: list[list[StepDigest]]
    data_files: NotRequired[dict[str, str]]  # {path: sha256} of the caches the data were read from
    env: NotRequired[dict | None]
    kernel_path: NotRequired[dict | None]


def validate_store_meta(path: Path, meta: dict) -> ProbeStoreMeta:
    """A probe store's metadata, field by field, then the rules across its fields."""
    c = Checker(path)
    check_typed(c, meta, ProbeStoreMeta, "metadata")
    n_images, sizes = meta["n_images"], meta["fold_sizes"]
    if meta["bin_index"] < 0:
        c.fail("metadata.bin_index", f"{meta['bin_index']} is negative")
    if len(sizes) < 2 or not all(type(n) is int and n >= 1 for n in sizes) or sum(sizes) != n_images:
        c.fail("metadata.fold_sizes", f"{show(sizes)} must be ≥ 2 positive counts summing to "
               f"n_images={n_images}")
    offset = 0
    for i, g in enumerate(meta["layout"]):
        if g["offset"] != offset or g["numel"] < 0:
            c.fail(f"metadata.layout[{i}]", "offsets and sizes do not tile the columns")
        offset += g["numel"]
    names = [g["name"] for g in meta["layout"]]
    if len(set(names)) != len(names):
        c.fail("metadata.layout", "parameter names repeat: each names one tensor of the store")
    _validate_kernel_path(c, meta)
    halves = meta.get("half_draws")
    if halves is not None and (len(halves) != 2 or min(halves) < 1 or sum(halves) != meta["n_draws"]):
        c.fail("metadata.half_draws", f"{show(halves)} must be two positive draw counts summing to "
               f"n_draws={meta['n_draws']}")
    return meta


def validate_train_store_meta(path: Path, meta: dict, n_tensors: dict[str, list[int]]) -> TrainStoreMeta:
    """A training store's metadata, field by field, then against its tensors (`n_tensors`: name -> shape):
    one weight tensor per layout entry, of the layout's shape, and one digest per step of the unit."""
    c = Checker(path)
    check_typed(c, meta, TrainStoreMeta, "metadata")
    if not 0 <= meta["from_step"] <= meta["to_step"] or meta["unit_index"] < 0:
        c.fail("metadata.to_step", f"steps {meta['from_step']} … {meta['to_step']} of unit "
               f"{meta['unit_index']} are not a segment")
    for i, w in enumerate(meta["layout"]):
        if n_tensors.get(f"weight/{w['name']}") != w["shape"]:
            c.fail(f"metadata.layout[{i}]", f"weight {w['name']!r} is not a tensor of shape {w['shape']}")
    digests = meta["step_digests"]
    if (len(digests) != meta["to_step"] - meta["from_step"]
            or any(len(d) != len(meta["layout"]) for d in digests)):
        c.fail("metadata.step_digests", "not one digest per weight for every step of the unit")
    # A frozen weight is blank at every step but the last, where every weight is hashed.
    frozen = [not d for d in digests[0]] if len(digests) > 1 else [False] * len(meta["layout"])
    for k, step in enumerate(digests):
        blank = [not d for d in step]
        if blank != (frozen if k < len(digests) - 1 else [False] * len(step)):
            c.fail(f"metadata.step_digests[{k}]", "blank digests must be a frozen weight's, at every step "
                   "but the unit's last, where every weight is hashed")
    _validate_kernel_path(c, meta)
    return meta
def _validate_kernel_path(c: Checker, meta: ProbeStoreMeta) -> None:
    """The kernel-path object is what its digest says (the digest alone is what run.json, the straddling
    rule and the checks compare: an object rewritten under the old digest would pass them all)."""
    recorded = (meta.get("env") or {}).get("kernel_path_sha256")
    if meta.get("kernel_path") is None or recorded is None:
        return
    try:
        actual = kernel_path_sha256({"kernel_path": meta["kernel_path"]})
    except (TypeError, ValueError):  # keys JSON cannot sort, values it cannot encode
        actual = None
    if actual != recorded:
        c.fail("metadata.kernel_path", f"does not hash to its digest env.kernel_path_sha256 "
               f"({show(recorded)})")
