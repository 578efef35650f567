"""Experiment 5, matched-state capacity: distinct items + a fixed block of 20 filler tokens.

Protocol (fixed features; per trial seeded ``default_rng([seed, n_items, trial])``):

1. d = 16, dv = 16. ``n_items`` in {8, 16, 24, 32, 40} content keys, *near-orthogonal*: the rows of a
   random orthogonal matrix restricted to d columns (orthonormal for n <= d, a random unit-norm tight
   frame for n > d), scaled to norm sqrt(d). Values ``v ~ N(0, I_dv)``.
2. Sequence: the items in random order, then a fixed block of 20 filler tokens
   ``f + 0.05 N(0, I_d)`` (one random prototype ``f ~ N(0, I_d)``, value 0).
3. Each item is queried with ``key + query_noise * N(0, I_d)`` (query_noise = 0.3) after the sequence;
   recall@1 = the readout's nearest item value (Euclidean) is the right one.
4. Methods: **SV-Attention** (exact solver, ``C = 1/(nu n0)`` with nu = 0.5, n0 = 8 + 20 = 28, fixed;
   ``sigma^2 = 2 sqrt(d)``, RBF readout), **DeltaNet** (beta = 1, normalised keys/queries, final state
   d x dv), **linear attention** (``elu + 1``, final normalised state).
5. State: DeltaNet's and linear attention's state is d * dv = 256 floats (+ d for the normaliser of
   linear attention) for every n, i.e. the same key/value width as SV-Attention's; SV-Attention keeps its
   support set, ``|S u E| * (d + dv)`` floats, which grows with the support. Both are reported per n;
   the floats are *not* equal (this implementation does not know the paper's exact matching rule).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tqdm import tqdm

from sv_attention.experiments._common import mean, nearest, row
from sv_attention.experiments.selective_copy import baseline_readouts

PUBLISHED = {"deltanet_recall": [0.93, 0.06], "sv_recall_through_24": 1.0, "sv_recall_at_40": 0.95,
             "sv_support": [9, 37],
             "note": "published: DeltaNet 0.93 -> 0.06, SV ~1.0 through 24 items and 0.95 at 40, support 9 -> 37"}
METHODS = ("sv", "deltanet", "linear")


def near_orthogonal_keys(n: int, d: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, d]`` rows of a random orthogonal matrix restricted to d columns, each scaled to norm sqrt(d)."""
    m = max(n, d)
    q, r = np.linalg.qr(rng.standard_normal((m, m)))
    q = q * np.sign(np.diag(r))[None, :]
    x = q[:n, :d]
    return np.sqrt(d) * x / np.linalg.norm(x, axis=1, keepdims=True)


def run_capacity(items: tuple[int, ...] = (8, 16, 24, 32, 40), trials: int = 30, seed: int = 0, d: int = 16,
                 dv: int = 16, n_fillers: int = 20, filler_noise: float = 0.05, query_noise: float = 0.3,
                 nu: float = 0.5, n0: int = 28, sigma: float | None = None,
                 progress: bool = False) -> dict[str, Any]:
    """Run the matched-state capacity comparison; returns the JSON payload (see the module docstring)."""
    from sv_attention.svdd import IncrementalSVDD

    sigma = float(np.sqrt(2.0 * np.sqrt(d))) if sigma is None else float(sigma)
    raw: dict[int, list[dict[str, Any]]] = {n: [] for n in items}
    for n, t in tqdm([(n, t) for n in items for t in range(trials)], desc="capacity", disable=not progress):
        rng = np.random.default_rng([seed, n, t])
        keys_i = near_orthogonal_keys(n, d, rng)
        vals_i = rng.standard_normal((n, dv))
        order = rng.permutation(n)
        proto = rng.standard_normal(d)
        fill = proto + filler_noise * rng.standard_normal((n_fillers, d))
        keys = np.vstack([keys_i[order], fill])
        vals = np.vstack([vals_i[order], np.zeros((n_fillers, dv))])
        q = keys_i + query_noise * rng.standard_normal(keys_i.shape)

        solver = IncrementalSVDD.from_nu(nu, n0, sigma)
        rec = solver.add(keys, ids=np.arange(len(keys)))
        outs = {"sv": solver.readout(q, vals), **baseline_readouts(keys, vals, q)}
        alpha = solver.alpha_of(np.arange(len(keys)))
        r = {m: float((nearest(outs[m], vals_i) == np.arange(n)).mean()) for m in METHODS}
        sup = int((alpha > 0).sum())
        r.update({"trial": t, "support": sup, "items_in_support": int((alpha[:n] > 0).sum()),
                  "sv_state_floats": sup * (d + dv), "kkt_max": float(rec.kkt.max), "fallback": bool(rec.fallback)})
        raw[n].append(r)
    per = {}
    for n in items:
        rs = raw[n]
        per[str(n)] = {**{f"{m}_recall": mean([x[m] for x in rs]) for m in METHODS},
                       "support_mean": mean([x["support"] for x in rs]),
                       "support_min": int(min(x["support"] for x in rs)),
                       "support_max": int(max(x["support"] for x in rs)),
                       "sv_state_floats_mean": mean([x["sv_state_floats"] for x in rs]),
                       "deltanet_state_floats": d * dv, "linear_state_floats": d * dv + d,
                       "fallbacks": int(sum(x["fallback"] for x in rs))}
    first, last = str(items[0]), str(items[-1])
    summary = {"per_items": per,
               "deltanet_recall_first_last": [per[first]["deltanet_recall"], per[last]["deltanet_recall"]],
               "sv_recall_first_last": [per[first]["sv_recall"], per[last]["sv_recall"]],
               "support_first_last": [per[first]["support_mean"], per[last]["support_mean"]]}
    table = [
        row(f"DeltaNet recall@1, {first} -> {last} items", "0.93 -> 0.06",
            "{:.2f} -> {:.2f}".format(*summary["deltanet_recall_first_last"])),
        row(f"SV-Attention recall@1, {first} -> {last} items", "~1.0 (through 24) -> 0.95",
            "{:.2f} -> {:.2f}".format(*summary["sv_recall_first_last"])),
        row(f"SV support |S u E|, {first} -> {last} items", "9 -> 37",
            "{:.1f} -> {:.1f}".format(*summary["support_first_last"])),
    ]
    for n in items:
        pn = per[str(n)]
        table.append(row(f"{n} items: recall@1 SV / DeltaNet / linear", None,
                         " / ".join(f"{pn[f'{m}_recall']:.2f}" for m in METHODS)))
    return {
        "experiment": "capacity",
        "protocol": __doc__.split("Protocol", 1)[1].strip(),
        "parameters": {"items": list(items), "trials": trials, "d": d, "dv": dv, "n_fillers": n_fillers,
                       "filler_noise": filler_noise, "query_noise": query_noise, "nu": nu, "n0": n0,
                       "C": 1.0 / (nu * n0), "sigma": sigma, "deltanet_beta": 1.0},
        "seeds": {"base": seed, "per_trial": "numpy default_rng([seed, n_items, trial])"},
        "trials": {str(n): raw[n] for n in items},
        "summary": summary,
        "published": PUBLISHED,
        "table": table,
    }
