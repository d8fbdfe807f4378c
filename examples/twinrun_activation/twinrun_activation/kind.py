"""A measurement kind of your own: the mean activation of one module per noise level σ, in both arms.

    python -m twinrun measure=activation intervention=pin_sigma plugin.module=blocks.0

For each σ bin of `sigma_grid` (its units), every arm denoises the same images noised with the same
keyed noise (twinrun.draws) and this kind stores each image's mean activation of `plugin.module`. Its
reducer reads, per bin, the paired difference of the arm's activations from the twin's (mean ± SE over
images); its gate is the probe's: at a bin where the intervention claims to be a no-op the arms must be
bit-identical (twinrun.analysis.gates.decide, with the twin's replicate measured at gate bins).

Everything else — planning, the job (locks, run.json, fingerprint, sentinel, failures, resume), the
launchers, status, the table and the trackers — is twinrun's, unchanged: this file and one entry point
in pyproject.toml are the whole kind.
"""

import hashlib
import json
import math
import os
from pathlib import Path
from typing import TypedDict

import safetensors.torch
import torch
from omegaconf import DictConfig, OmegaConf

from twinrun import draws
from twinrun.analysis.gates import decide
from twinrun.analysis.reduction import (
    Reduction,
    check,
    provenance_checks,
    registered,
    used_settings,
    view_name,
)
from twinrun.analysis.vouch import StoreRules, Voucher
from twinrun.errors import ConfigError, StoreError
from twinrun.files import atomic_write, open_regular
from twinrun.instantiate import build
from twinrun.interventions import Intervention, attached
from twinrun.measures.failures import as_model_error
from twinrun.measures.kind import Measure, Plan, parse_device
from twinrun.provenance.record import model_sha256, read_sentinel, tensors_sha256
from twinrun.storage.records import GATE_REPLICATE, UnitEntry
from twinrun.storage.run_paths import REPORT_MD
from twinrun.storage.rundir import RunIndex

FORMAT = "twinrun-activation-store/1"
DEFAULTS = {"module": "blocks.0", "n_images": 16, "device": "auto"}


class ActivationUnit(TypedDict):
    sigma: float  # the bin's noising σ


def settings(node) -> dict:
    """The kind's settings: `plugin.*` over DEFAULTS (the kind checks its own keys)."""
    given = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        key = min(unknown)
        raise ConfigError(f"plugin.{key}", given[key],
                          f"not a setting of measure=activation; use {', '.join(DEFAULTS)}")
    return {**DEFAULTS, **given}


# ----------------------------------------------------------------------------- planning


def validate(cfg: DictConfig, intervention: Intervention):
    s = settings(cfg.plugin)
    if not isinstance(s["n_images"], int) or s["n_images"] < 2:
        raise ConfigError("plugin.n_images", s["n_images"], "must be an integer ≥ 2 (the SE needs two)")
    parse_device("plugin.device", s["device"])
    grid = [float(x) for x in cfg.sigma_grid.sigmas]
    intervention.check(grid)
    if not intervention.gate_sigmas(grid) and intervention.noop() is None:
        raise ConfigError("intervention", type(intervention).__name__, "has no gate bin and no no-op "
                          "setting: nothing would vouch for the instrument")
    images, _ = build(OmegaConf.to_container(cfg.data, resolve=True), "data")
    model = build(OmegaConf.to_container(cfg.model, resolve=True), "model")
    if s["module"] not in dict(model.named_modules()):
        raise ConfigError("plugin.module", s["module"], "is no module of the model; e.g. blocks.0")
    if s["n_images"] > images.shape[0]:
        raise ConfigError("plugin.n_images", s["n_images"], f"the data hold only {images.shape[0]} images")
    return grid


def plan(cfg: DictConfig, intervention: Intervention, arms: list, run_dir: Path | None, grid) -> Plan:
    gates = set(intervention.gate_sigmas(grid))
    units = [{"index": k, "label": f"bin {k} (σ={sigma:g})", "gate": sigma in gates,
              "activation": {"sigma": sigma}, "file": f"bin{k}_sigma{sigma:g}.safetensors"}
             for k, sigma in enumerate(grid)]
    n = settings(cfg.plugin)["n_images"]
    return Plan(units=units, store_bytes=len(arms) * len(units) * (4 * n + 4096))


# ----------------------------------------------------------------------------- the job's session


class ActivationSession:
    compile_mode = None

    def __init__(self, config: dict, arms: list, device: torch.device):
        self.s, self.seed, self.device = settings(config["plugin"]), config["seed"], device
        self.model = build(config["model"], "model").to(device).eval()
        images, ids = build(config["data"], "data")
        self.images, self.ids = images[: self.s["n_images"]].to(device), list(ids[: self.s["n_images"]])
        self.interventions = {a.name: build(a.config["intervention"], "intervention") for a in arms}
        self.module = dict(self.model.named_modules())[self.s["module"]]
        self.identity = {"model_sha256": model_sha256(self.model),
                         "data_sha256": tensors_sha256([("images", self.images)])}
        self.eps = None

    def arithmetic(self) -> dict:
        return {"device": self.device.type}

    def sentinel(self) -> dict:
        return read_sentinel(self.model, self.device, tuple(self.images.shape[1:]))

    def begin_unit(self, u: UnitEntry) -> None:
        sigma = u["activation"]["sigma"]
        self.eps = draws.noise(self.seed, sigma, self.ids, 1, tuple(self.images.shape[1:]))[:, 0]
        self.digest = draws.digest(self.eps, sigma)

    def measure(self, u: UnitEntry, arm: str, stamp: dict) -> tuple[dict, dict]:
        sigma, intervention = u["activation"]["sigma"], self.interventions[arm]
        seen = []
        hook = self.module.register_forward_hook(
            lambda m, a, out: seen.append(out.detach().flatten(1).mean(1)))
        try:
            with torch.no_grad(), attached(intervention, self.model):
                sig = torch.full((self.images.shape[0],), sigma, device=self.device)
                as_model_error(arm, u, self.model, self.images + sigma * self.eps.to(self.device), sig,
                               intervention.sigma_cond(sig))
        finally:
            hook.remove()
        meta = {"arm": arm, "unit_index": u["index"], "sigma": sigma, "draws_digest": self.digest,
                "module": self.s["module"],
                "config_hash": stamp["config_hash"], "env": stamp["env"]}
        return {"activation": seen[0].float().cpu()}, meta


def write_store(path: Path, tensors: dict, meta: dict) -> str:
    strings = {"format": FORMAT, **{k: json.dumps(v) for k, v in meta.items()}}
    return atomic_write(Path(path), safetensors.torch.save(tensors, metadata=strings))


def read_store(path: Path, sha256: str | None = None, payload_bytes: int | None = None):
    """(activations [n], metadata), the file's size bounded and its sha256 checked: untrusted input."""
    fd, size = open_regular(Path(path), 1 << 26, "store")
    try:
        with open(fd, "rb", closefd=False) as f:
            data = f.read(size)
    finally:
        os.close(fd)
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise StoreError(path, "sha256 does not match run.json: altered or damaged")
    try:
        tensors = safetensors.torch.load(data)
        raw = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
        meta = {k: json.loads(v) for k, v in raw.items() if k != "format"}
        activation = tensors["activation"]
    except Exception as err:  # noqa: BLE001 — damaged bytes are one named error
        raise StoreError(path, f"not an activation store ({type(err).__name__})") from None
    if raw.get("format") != FORMAT or activation.dim() != 1 or not bool(torch.isfinite(activation).all()):
        raise StoreError(path, "not a whole activation store: damaged or forged")
    return activation, meta


def verify(path: Path, sha256: str | None = None, payload_bytes: int | None = None) -> dict:
    return read_store(path, sha256)[1]


# ----------------------------------------------------------------------------- its reducer


def analyse(index: RunIndex, stores: dict, used: dict) -> dict:
    inter, twin = index.arm("intervention")["name"], index.arm("twin")["name"]
    digests = {(m["draws_digest"], i) for (_, i), (_, m) in stores.items()}
    checks = [check("identical_draws", len(digests) == len(index.units), "every arm of a bin consumed the "
                    "same noise" if len(digests) == len(index.units) else "draws differ between arms")]
    checks += provenance_checks(index, {k: type("S", (), {"meta": m}) for k, (_, m) in stores.items()})
    gates, effects = [], []
    for u in index.units:
        i, sigma = u["index"], u["activation"]["sigma"]
        a, t = stores[inter, i][0].double(), stores[twin, i][0].double()
        if u["gate"]:
            shift = float((a - t).abs().max())
            rep = (float((stores[GATE_REPLICATE, i][0].double() - t).abs().max())
                   if (GATE_REPLICATE, i) in stores else None)
            passed, rule = decide(shift == 0.0, shift, rep, used["gate_rule"])
            gates.append({"sigma": sigma, "estimand": "activation", "passed": passed, "rule": rule,
                          "max_abs_diff": shift})
        d = a - t
        effects.append({"sigma": sigma, "estimand": "activation", "value": float(d.mean()),
                        "se": float(d.std() / math.sqrt(d.numel())), "arm_mean": float(a.mean()),
                        "twin_mean": float(t.mean())})
    checks_passed = all(c["passed"] for c in checks)
    passed = checks_passed and all(g["passed"] for g in gates)
    return {"measure": "activation", "run_dir": str(index.run_dir.path), "arms": index.arm_names,
            "registered": registered(index), "used": {**used, "estimands": ["activation"]},
            "checks_passed": checks_passed, "passed": passed, "checks": checks, "gates": gates,
            "effects": effects if passed else []}


# What each store must agree with, held by twinrun's one reader standard (analysis/vouch.py) beside
# its arm, unit, config hash and kernel path: its bin's σ, and the first store's module.
RULES = StoreRules("unit_index", {"sigma": "sigma"}, {}, ("module",))


def reduce_run(run_dir: Path, estimands=None, gate_rule=None, signal_alpha=None, family_alpha=None):
    index = RunIndex.load(run_dir)
    voucher = Voucher(index, RULES)
    stores = {}
    for u in index.units:
        for arm, e in u["stores"].items():
            path = index.store_path(u, arm)
            stores[arm, u["index"]] = read_store(path, e["sha256"])
            voucher.store(u, arm, path, stores[arm, u["index"]][1])
    reg = registered(index)
    used = used_settings(reg, estimands, gate_rule, signal_alpha, family_alpha)
    summary = analyse(index, stores, reg)
    if used == reg:
        return Reduction(index, summary)
    name = view_name(reg, used)
    return Reduction(index, summary, {**analyse(index, stores, used), "post_hoc": {"used": used}}, name)


def render(summary: dict) -> str:
    lines = [f"twinrun reduce (activation): {summary['run_dir']}"]
    lines += [f"  [{'ok' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}" for c in summary["checks"]]
    lines += [f"  [{'ok' if g['passed'] else 'FAIL'}] gate σ={g['sigma']:g}: {g['rule']}"
              for g in summary["gates"]]
    if not summary["passed"]:
        return "\n".join([*lines, "instrument broken: no effect is shown"])
    lines += [f"  σ={e['sigma']:<6g} mean activation, arm − twin: {e['value']:+.4e} ± {e['se']:.1e}"
              for e in summary["effects"]]
    return "\n".join(lines)


def report(out_dir: Path, summary: dict, index: RunIndex) -> Path:
    path = Path(out_dir) / REPORT_MD
    atomic_write(path, f"# activation report\n\n```\n{render(summary)}\n```\n".encode())
    return path


ACTIVATION = Measure(
    name="activation",
    settings_key="plugin",
    unit_noun="bin",
    validate=validate,
    plan=plan,
    protocol_keys=("data", "sigma_grid", "seed", "plugin.module", "plugin.n_images"),
    open_session=ActivationSession,
    device=lambda config: settings(config.get("plugin"))["device"],
    reduce=reduce_run,
    report=report,
    render=render,
    config_keys=("sigma_grid", "plugin"),
    unit_fields=ActivationUnit,
    increasing="sigma",
    unit_key="sigma",
    unit_own="sigma",
    write_store=write_store,
    verify_store=verify,
)
