"""The pairing receipt of every effect row, from the pairing blocks the probe stores beside the fold sums.

Each store carries, per probed parameter tensor, float64 F×F blocks of its fold sums S and half-draw
differences H (twinrun.measures.probe.pairing_meta): the twin's ⟨S,H⟩ and ⟨H,H⟩; every other arm's own two
and ⟨S,H^tw⟩, ⟨S^tw,H⟩, ⟨H,H^tw⟩ against the twin. An estimand's blocks are the sums over the tensors it
selects; twinrun.analysis.pairing turns them into the row's receipt. A view that mixes bins (`residual`)
and a run of one draw an image (no halves) have none, and the row says why.
"""

import base64
import binascii
import math

import numpy as np

from twinrun.analysis.estimands import registry
from twinrun.analysis.pairing import PairingBlocks, pairing_receipt
from twinrun.errors import StoreError

TWIN_KEYS = ("s_h", "h_h")
ARM_KEYS = ("s_h", "h_h", "s_htwin", "stwin_h", "h_htwin")
EMPTY = {"pairing_rho": None, "pairing_gain": None, "pairing_gain_ratio": None, "pairing_gain_effect": None,
         "draw_share": None}


def decode_blocks(reader, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """{key: [n_tensors, F, F] float64} from a store's `pairing` metadata; a malformed block is a StoreError
    naming the store and the field (exit 2), never a number."""
    pairing = reader.meta.get("pairing")
    n_tensors, f = len(reader.meta["layout"]), len(reader.meta["fold_sizes"])
    # The blocks are base64 text in a store's metadata, which anyone may edit: each is decoded, sized and
    # checked finite before a receipt reads it.
    out = {}
    for key in keys:
        field = f"metadata.pairing.{key}"
        text = pairing.get(key) if isinstance(pairing, dict) else None
        if not isinstance(text, str):
            raise StoreError(reader.path, f"field {field}: missing (a store of a run with two or more draws "
                             "an image holds its pairing blocks): measure the run again into a new run "
                             "directory")
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise StoreError(reader.path, f"field {field}: not base64") from None
        if len(raw) != 8 * n_tensors * f * f:
            raise StoreError(reader.path, f"field {field}: {len(raw)} bytes, not {n_tensors} × {f} × {f} "
                             "float64 (one F×F block per probed parameter)")
        block = np.frombuffer(raw, dtype="<f8").reshape(n_tensors, f, f)
        if not np.isfinite(block).all():
            raise StoreError(reader.path, f"field {field}: holds NaN or inf")
        out[key] = block
    return out


def no_receipt_reason(estimand: str, groups: dict | None, meta: dict) -> str | None:
    """Why a row has no pairing receipt, or None where it has one (meta: the twin store's metadata)."""
    if "half_draws" not in meta:
        return "stores measured before the pairing blocks were stored: no receipt"
    if meta["half_draws"] is None:
        return "one draw an image: no halves of the draws to tell draw noise from image noise"
    if registry(groups)[estimand].derive is not None:
        return "a view that mixes bins (its folds hold every bin's twin): no receipt"
    return None


def _finite(x) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def receipt_fields(twin_reader, arm_reader, gram: np.ndarray, a: int, t: int, estimand: str,
                   groups: dict | None, printed: bool) -> dict:
    """One row's receipt fields (EMPTY where it has none, with `pairing_note` saying why). gram: the
    estimand's within-bin blocks of this bin [A, F, A, F]; a, t: the intervention's and the twin's rows."""
    meta = twin_reader.meta
    why = no_receipt_reason(estimand, groups, meta)
    if why is not None:
        return {**EMPTY, "pairing_note": why}
    selects = registry(groups)[estimand].selects
    keep = np.array([selects(entry) for entry in meta["layout"]])
    tw = {k: v[keep].sum(0) for k, v in decode_blocks(twin_reader, TWIN_KEYS).items()}
    ar = {k: v[keep].sum(0) for k, v in decode_blocks(arm_reader, ARM_KEYS).items()}
    blocks = PairingBlocks(g_ab=gram[a, :, t], g_aa=gram[a, :, a], g_bb=gram[t, :, t], q_aa=ar["s_h"],
                           q_ab=ar["s_htwin"], q_ba=ar["stwin_h"], q_bb=tw["s_h"], r_aa=ar["h_h"],
                           r_ab=ar["h_htwin"], r_bb=tw["h_h"])
    n = np.asarray(meta["fold_sizes"], dtype=np.float64) * meta["n_draws"]  # samples per fold
    r = pairing_receipt(blocks, n, printed)
    return {"pairing_rho": _finite(r.rho), "pairing_gain": _finite(r.gain_cos),
            "pairing_gain_ratio": _finite(r.gain_ratio), "pairing_gain_effect": _finite(r.gain_effect),
            "draw_share": _finite(r.draw_share), "pairing_note": None}
