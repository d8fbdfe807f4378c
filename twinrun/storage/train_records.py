"""A training run's summary.json as a type (the train kind's `summary_type`, measures/train.py), checked
field by field as storage/records.py checks every document."""

from typing import Annotated, Literal, NotRequired, TypedDict

from twinrun.storage.records import Check, Num, PostHoc

Step = Annotated[int, "non-negative"]


class Analysis(TypedDict):
    """The settings of one reading: registered at plan time, or those a post-hoc view used."""

    estimands: list[str]
    gate_rule: str
    signal_alpha: Num
    family_alpha: NotRequired[Num]
    groups: NotRequired[dict[str, list[str]]]


class FirstDiffering(TypedDict):
    arm: str
    step: Step | None  # None: never left the twin's bits
    first_tensor: str | None
    n_differ: int
    n_tensors: int
    # a replicate measured in the first segments only (arms.replicate_segments): the last step it was
    measured_through: NotRequired[Step | None]


class FloorRow(TypedDict):
    step: Step
    estimand: str
    distance: Num | None
    cos: Num | None
    norm_ratio: Num | None
    # each chaos arm's distance, their spread (largest / smallest) and the margin it sets: absent in a
    # summary written before a run had several chaos arms
    chaos_distances: NotRequired[list[Num | None]]
    spread: NotRequired[Num]
    margin: NotRequired[Num]


class TrainEffectRow(TypedDict):
    step: Step
    estimand: str
    cos: Num | None
    norm_ratio: Num | None
    distance: Num | None
    floor: Num | None
    margin: Num
    floor_ratio: Num | None
    above_floor: bool
    # train.floor_scope=model where the model's floor was the larger: whose it is, and the estimand's own
    floor_from: NotRequired[str]
    own_floor: NotRequired[Num | None]
    own_floor_ratio: NotRequired[Num | None]


class LossRow(TypedDict):
    step: Step
    arm: str
    role: str
    train_loss: Num | None
    train_loss_steps: list[Num]
    heldout_loss: Num
    heldout_se: float  # NaN for one held-out image (no spread to read), as are the next two
    heldout_diff: Num
    heldout_diff_se: float
    heldout_diff_significant: bool
    t_crit: float


class TrainGateRow(TypedDict):
    """The training run's no-op gate at one stored step: the machinery arm against the twin."""

    step: Step
    arm: str
    passed: bool
    rule: str  # which rule decided it (bit-identical, not a no-op on a deterministic path, ...)
    bit_identical: bool
    distance: Num  # |θ_arm − θ_twin| / |θ_twin − θ_start| over every parameter
    replicate_distance: float | None  # the largest replicate's
    replicate_distances: NotRequired[list[float]]  # each replicate's, where the machinery arm differs
    wobble_bound: NotRequired[float | None]
    first_tensor: str | None  # the first parameter (in the model's order) whose bits differ
    detail: str


class TrainSummary(TypedDict):
    """What one reduction of a training run found: checks, gates, then the floor and the effects (empty
    unless every check and gate passed)."""

    measure: Literal["train"]
    run_dir: str
    arms: list[str]
    registered: Analysis
    used: Analysis
    checks_passed: bool
    passed: bool
    verdict: str  # one sentence: above the chaos floor, or not told apart from chaos
    checks: list[Check]
    gates: list[TrainGateRow]
    replicate: dict | None
    first_differing: list[FirstDiffering]  # per arm: the first step its bits leave the twin's, the tensor
    floor: list[FloorRow]  # per stored step and estimand: the chaos arm's distance from the twin
    effects: list[TrainEffectRow]  # per stored step and estimand: the intervention against twin and floor
    losses: list[LossRow]  # per stored step and arm: training and held-out loss (paired SE against twin)
    # train.floor_scope the effects were read under (absent in a summary written before it existed)
    floor_scope: NotRequired[Literal["model", "estimand"]]
    post_hoc: NotRequired[PostHoc]
    data_files: NotRequired[dict[str, str]]  # {path: sha256} of the caches the data were read from
