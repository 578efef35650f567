"""Experiment 1, planted secret: exact deletion vs decay of a distinctive (key, value) pair.

Protocol (per trial, seeded ``numpy.random.default_rng([seed, trial])``):

1. 14 ordinary keys ``x_i ~ N(0, I_d)`` (d = 4) and one *secret* key ``x_s = r u`` with ``u`` a random
   unit vector and ``r = secret_radius`` (3.0: a distinctive key outside the ordinary cloud, whose
   typical radius is ~1.9). Values ``v_i ~ N(0, I_dv)`` (dv = 8), the secret's included.
2. An exact solver with ``C = 1 / (nu n0)`` (nu = 0.5, n0 = 15 -> C = 2/15, fixed) and sigma = 1.5 is fit
   on the 15 keys (incremental admissions). Probes: ``probes_per_key`` points ``x_i + N(0, probe_noise^2 I)``
   near *every* key.
3. *Retrieved* means: the RBF readout at a probe near the secret key is nearer (Euclidean) to the secret's
   value than to any other value in the context. Rates are averaged over the secret's probes and trials.
4. **Exact deletion**: ``remove([secret])`` (the decrement); compared with ``refit`` of the 14 ordinary
   keys with the same C ("a layer that never saw it"). Deviation = max over all probes and value
   dimensions of ``|o_deleted - o_never|``; the decision function is compared the same way.
5. **Decay** baselines: the secret stays, its coefficient multiplied by gamma in {0.5, 0.1, 0.01} (the
   readout renormalises); same deviation and retrieval metrics against the never-saw-it layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tqdm import tqdm

from sv_attention.experiments._common import mean, nearest, rbf_readout, row

PUBLISHED = {
    "retrieval_before": 0.80,
    "retrieval_after_exact": 0.0,
    "max_readout_deviation_exact": 8.9e-5,
    "decay": {"0.5": {"deviation": 0.57, "retrieval": 0.80},
              "0.1": {"deviation": 0.34, "retrieval": 0.40},
              "0.01": {"deviation": 0.16, "retrieval": 0.07}},
}


def run_secret(trials: int = 30, seed: int = 0, d: int = 4, n_ordinary: int = 14, sigma: float = 1.5,
               nu: float = 0.5, n0: int = 15, secret_radius: float = 3.0, dv: int = 8,
               probes_per_key: int = 4, probe_noise: float = 0.1,
               gammas: tuple[float, ...] = (0.5, 0.1, 0.01), progress: bool = False) -> dict[str, Any]:
    """Run the planted-secret experiment; returns the JSON payload (see the module docstring).

    Parameters
    ----------
    trials : number of independent trials
    seed : base seed; trial t uses ``default_rng([seed, t])``
    d, n_ordinary, sigma, nu, n0, secret_radius, dv, probes_per_key, probe_noise, gammas : protocol knobs
    progress : show a tqdm bar
    """
    from sv_attention.svdd import IncrementalSVDD, refit

    rows = []
    s_id = n_ordinary
    for t in tqdm(range(trials), desc="secret", disable=not progress):
        rng = np.random.default_rng([seed, t])
        xo = rng.standard_normal((n_ordinary, d))
        u = rng.standard_normal(d)
        xs = secret_radius * u / np.linalg.norm(u)
        keys = np.vstack([xo, xs[None]])
        vals = rng.standard_normal((n_ordinary + 1, dv))
        owner = np.repeat(np.arange(n_ordinary + 1), probes_per_key)
        probes = keys[owner] + probe_noise * rng.standard_normal((owner.size, d))
        sp = owner == s_id
        by_id = {i: vals[i] for i in range(n_ordinary + 1)}

        solver = IncrementalSVDD.from_nu(nu, n0, sigma)
        solver.add(keys, ids=np.arange(n_ordinary + 1))
        alpha = solver.alpha_of(np.arange(n_ordinary + 1))
        o_before = solver.readout(probes, by_id)
        ret_before = float((nearest(o_before[sp], vals) == s_id).mean())

        decay = {}
        never = refit(xo, solver.C, sigma, ids=np.arange(n_ordinary))
        o_never = never.readout(probes, by_id)
        for g in gammas:
            w = alpha.copy()
            w[s_id] *= g
            o_g = rbf_readout(probes, keys, w, vals, sigma)
            decay[str(g)] = {"deviation": float(np.abs(o_g - o_never).max()),
                             "retrieved": float((nearest(o_g[sp], vals) == s_id).mean())}

        rec = solver.remove([s_id])
        o_after = solver.readout(probes, by_id)
        dev = float(np.abs(o_after - o_never).max())
        df_dev = float(np.abs(solver.decision_function(probes) - never.decision_function(probes)).max())
        alpha_dev = float(np.abs(solver.alpha_of(np.arange(n_ordinary)) - never.alpha).max())
        rows.append({
            "trial": t, "secret_alpha_before": float(alpha[s_id]),
            "secret_in_support_before": bool(alpha[s_id] > 0),
            "retrieved_before": ret_before,
            "retrieved_after_exact": float((nearest(o_after[sp], vals) == s_id).mean()),
            "readout_deviation_exact": dev, "decision_deviation_exact": df_dev,
            "alpha_deviation_exact": alpha_dev,
            "deletion_kkt_max": float(rec.kkt.max), "deletion_guard_events": int(rec.guard_events),
            "deletion_fallback": bool(rec.fallback),
            "readout_deviation_without_forgetting": float(np.abs(o_before - o_never).max()),
            "decay": decay,
        })

    summ_decay = {}
    for g in gammas:
        devs = [r["decay"][str(g)]["deviation"] for r in rows]
        summ_decay[str(g)] = {"deviation_mean": mean(devs), "deviation_max": float(max(devs)),
                              "retrieval": mean([r["decay"][str(g)]["retrieved"] for r in rows])}
    summary = {
        "retrieval_before": mean([r["retrieved_before"] for r in rows]),
        "retrieval_after_exact": mean([r["retrieved_after_exact"] for r in rows]),
        "max_readout_deviation_exact": float(max(r["readout_deviation_exact"] for r in rows)),
        "max_decision_deviation_exact": float(max(r["decision_deviation_exact"] for r in rows)),
        "max_alpha_deviation_exact": float(max(r["alpha_deviation_exact"] for r in rows)),
        "secret_in_support_fraction": mean([r["secret_in_support_before"] for r in rows]),
        "fallbacks": int(sum(r["deletion_fallback"] for r in rows)),
        "decay": summ_decay,
    }
    table = [
        row("secret retrieved before deletion", PUBLISHED["retrieval_before"], summary["retrieval_before"]),
        row("secret retrieved after exact deletion", PUBLISHED["retrieval_after_exact"],
            summary["retrieval_after_exact"]),
        row("max readout deviation from never-saw-it layer (exact)", PUBLISHED["max_readout_deviation_exact"],
            summary["max_readout_deviation_exact"]),
    ]
    for g in gammas:
        pub = PUBLISHED["decay"].get(str(g), {})
        table.append(row(f"decay gamma={g}: readout deviation (mean of per-trial max)", pub.get("deviation"),
                         summ_decay[str(g)]["deviation_mean"]))
        table.append(row(f"decay gamma={g}: secret retrieved", pub.get("retrieval"),
                         summ_decay[str(g)]["retrieval"]))
    return {
        "experiment": "secret",
        "protocol": __doc__.split("Protocol", 1)[1].strip(),
        "parameters": {"trials": trials, "d": d, "n_ordinary": n_ordinary, "sigma": sigma, "nu": nu, "n0": n0,
                       "C": 1.0 / (nu * n0), "secret_radius": secret_radius, "dv": dv,
                       "probes_per_key": probes_per_key, "probe_noise": probe_noise, "gammas": list(gammas)},
        "seeds": {"base": seed, "per_trial": "numpy default_rng([seed, trial])"},
        "trials": rows,
        "summary": summary,
        "published": PUBLISHED,
        "table": table,
    }
