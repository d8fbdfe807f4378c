"""A training run's summary.json as a type (the train kind's `summary_type`, measures/train.py), checked
field by field as storage/records.py checks every document."""

from typing import Literal, NotRequired, TypedDict

from twinrun.storage.records import Check, PostHoc


class TrainGateRow(TypedDict):
    """The training run's no-op gate at one stored step: the machinery arm against the twin."""

    step: int
    arm: str
    passed: bool
    rule: str  # which rule decided it (bit-identical, not a no-op on a deterministic path, ...)
    bit_identical: bool
    distance: float  # |θ_arm − θ_twin| / |θ_twin − θ_start| over every parameter
    replicate_distance: float | None
    first_tensor: str | None  # the first parameter (in the model's order) whose bits differ
    detail: str


class TrainSummary(TypedDict):
    """What one reduction of a training run found: checks, gates, then the floor and the effects (empty
    unless every check and gate passed)."""

    measure: Literal["train"]
    run_dir: str
    arms: list[str]
    registered: dict
    used: dict
    checks_passed: bool
    passed: bool
    verdict: str  # one sentence: above the chaos floor, or not told apart from chaos
    checks: list[Check]
    gates: list[TrainGateRow]
    replicate: dict | None
    first_differing: list[dict]  # per arm: the first step its bits leave the twin's (and the tensor)
    floor: list[dict]  # per stored step and estimand: the chaos arm's distance from the twin
    effects: list[dict]  # per stored step and estimand: the intervention against the twin and the floor
    losses: list[dict]  # per stored step and arm: training and held-out loss (paired SE against the twin)
    post_hoc: NotRequired[PostHoc]
