"""Experiment 8, exact editing: remove-and-add of a fact binding vs decay.

Protocol (per trial, seeded ``numpy.random.default_rng([seed, trial])``):

1. ``n_facts`` = 15 fact bindings: keys ``x_i ~ N(0, I_d)`` (d = 4), values ``v_i ~ N(0, I_dv)`` (dv = 8);
   exact solver with ``C = 1 / (nu n0)`` (nu = 0.5, n0 = 15 -> C = 2/15, fixed), sigma = 1.5.
2. One fact f (uniform at random) is edited: the new binding has the rephrased key
   ``x_new = x_f + rephrase_noise * N(0, I_d)`` (rephrase_noise = 0.05) and a fresh value ``v_new``.
3. **Exact edit**: ``remove([f])`` then ``add(x_new)`` on the maintained solver. **Reference**: ``refit`` of
   the edited fact set (the old binding never seen) with the same C.
4. **Decay edit** (baseline): the old binding is not removed; the new binding is admitted (a solver
   holds both keys) and the old binding's coefficient is multiplied by gamma in {0.5, 0.1, 0.01}.
5. Probes: ``probes_per_key`` points ``x + N(0, probe_noise^2 I)`` near every key of the edited set.
   **Residual influence** of the old binding = max over probes and value dimensions of
   ``|o_edit - o_reference|``. (When the old binding is a reserve key of the joint fit, alpha = 0, decay
   leaves no trace either; the fraction of such trials is reported.) At the probes near the edited fact we also decode the readout to the
   nearest value among all values ever bound (old values and ``v_new``) and count how often the old
   value comes back and how often the new one does (the never-saw-old reference's rates are reported
   beside them: a mixture of neighbours can land nearest to the old value by chance).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tqdm import tqdm

from sv_attention.experiments._common import mean, nearest, rbf_readout, row

PUBLISHED = {"residual_influence_exact": 0.0, "residual_influence_decay": 1.15,
             "note": "published: 0 to machine precision for the exact edit vs 1.15 for decay "
                     "(the decay factor used for 1.15 is not stated in the issue)"}


def run_edit(trials: int = 30, seed: int = 0, d: int = 4, n_facts: int = 15, sigma: float = 1.5,
             nu: float = 0.5, n0: int = 15, dv: int = 8, rephrase_noise: float = 0.05,
             probes_per_key: int = 4, probe_noise: float = 0.1,
             gammas: tuple[float, ...] = (0.5, 0.1, 0.01), progress: bool = False) -> dict[str, Any]:
    """Run the exact-editing experiment; returns the JSON payload (see the module docstring)."""
    from sv_attention.svdd import IncrementalSVDD, refit

    rows = []
    for t in tqdm(range(trials), desc="edit", disable=not progress):
        rng = np.random.default_rng([seed, t])
        x = rng.standard_normal((n_facts, d))
        v = rng.standard_normal((n_facts, dv))
        f = int(rng.integers(n_facts))
        x_new = x[f] + rephrase_noise * rng.standard_normal(d)
        v_new = rng.standard_normal(dv)
        new_id = n_facts
        ids_all = np.arange(n_facts + 1)
        keys_all = np.vstack([x, x_new[None]])
        vals_all = np.vstack([v, v_new[None]])
        by_id = {i: vals_all[i] for i in range(n_facts + 1)}
        kept = np.array([i for i in range(n_facts) if i != f] + [new_id])
        owner = np.repeat(kept, probes_per_key)
        probes = keys_all[owner] + probe_noise * rng.standard_normal((owner.size, d))
        near_f = owner == new_id

        solver = IncrementalSVDD.from_nu(nu, n0, sigma)
        solver.add(x, ids=np.arange(n_facts))
        old_alpha = float(solver.alpha_of([f])[0])
        rec_rm = solver.remove([f])
        rec_add = solver.add(x_new[None], ids=[new_id])
        ref = refit(keys_all[kept], solver.C, sigma, ids=kept)
        o_ref = ref.readout(probes, by_id)
        o_exact = solver.readout(probes, by_id)
        dec_exact = nearest(o_exact[near_f], vals_all)
        dec_ref = nearest(o_ref[near_f], vals_all)

        both = IncrementalSVDD(solver.C, sigma)
        both.add(keys_all, ids=ids_all)
        a_both = both.alpha_of(ids_all)
        decay = {}
        for g in gammas:
            w = a_both.copy()
            w[f] *= g
            o_g = rbf_readout(probes, keys_all, w, vals_all, sigma)
            dec = nearest(o_g[near_f], vals_all)
            decay[str(g)] = {"residual_influence": float(np.abs(o_g - o_ref).max()),
                             "old_value_returned": float((dec == f).mean()),
                             "new_value_returned": float((dec == new_id).mean())}
        rows.append({
            "trial": t, "edited_fact": f, "old_alpha": old_alpha,
            "old_alpha_in_joint_fit": float(a_both[f]),
            "residual_influence_exact": float(np.abs(o_exact - o_ref).max()),
            "decision_deviation_exact": float(np.abs(solver.decision_function(probes)
                                                     - ref.decision_function(probes)).max()),
            "old_value_returned_exact": float((dec_exact == f).mean()),
            "new_value_returned_exact": float((dec_exact == new_id).mean()),
            "new_value_returned_reference": float((dec_ref == new_id).mean()),
            "old_value_returned_reference": float((dec_ref == f).mean()),
            "kkt_max": float(max(rec_rm.kkt.max, rec_add.kkt.max)),
            "fallback": bool(rec_rm.fallback or rec_add.fallback),
            "decay": decay,
        })

    sd = {}
    for g in gammas:
        ri = [r["decay"][str(g)]["residual_influence"] for r in rows]
        sd[str(g)] = {"residual_influence_mean": mean(ri), "residual_influence_max": float(max(ri)),
                      "old_value_returned": mean([r["decay"][str(g)]["old_value_returned"] for r in rows]),
                      "new_value_returned": mean([r["decay"][str(g)]["new_value_returned"] for r in rows])}
    summary = {
        "residual_influence_exact_max": float(max(r["residual_influence_exact"] for r in rows)),
        "decision_deviation_exact_max": float(max(r["decision_deviation_exact"] for r in rows)),
        "old_value_returned_exact": mean([r["old_value_returned_exact"] for r in rows]),
        "new_value_returned_exact": mean([r["new_value_returned_exact"] for r in rows]),
        "new_value_returned_reference": mean([r["new_value_returned_reference"] for r in rows]),
        "old_value_returned_reference": mean([r["old_value_returned_reference"] for r in rows]),
        "old_binding_inert_in_joint_fit": mean([r["old_alpha_in_joint_fit"] == 0 for r in rows]),
        "fallbacks": int(sum(r["fallback"] for r in rows)),
        "decay": sd,
    }
    table = [row("residual influence of old binding, exact edit (max)", PUBLISHED["residual_influence_exact"],
                 summary["residual_influence_exact_max"])]
    for g in gammas:
        table.append(row(f"residual influence, decay gamma={g} (mean of per-trial max)",
                         PUBLISHED["residual_influence_decay"], sd[str(g)]["residual_influence_mean"],
                         note="published decay factor not stated"))
    table.append(row("edited probes answering the new value, exact edit", None,
                     summary["new_value_returned_exact"],
                     note=f"the never-saw-old reference answers it at {summary['new_value_returned_reference']:.3f}"))
    return {
        "experiment": "edit",
        "protocol": __doc__.split("Protocol", 1)[1].strip(),
        "parameters": {"trials": trials, "d": d, "n_facts": n_facts, "sigma": sigma, "nu": nu, "n0": n0,
                       "C": 1.0 / (nu * n0), "dv": dv, "rephrase_noise": rephrase_noise,
                       "probes_per_key": probes_per_key, "probe_noise": probe_noise, "gammas": list(gammas)},
        "seeds": {"base": seed, "per_trial": "numpy default_rng([seed, trial])"},
        "trials": rows,
        "summary": summary,
        "published": PUBLISHED,
        "table": table,
    }
