"""The incremental exact path of the gate (``solver="exact"``): fp64 maintained solvers fed by position.

The keys of each (sequence, kv-head) are streamed, in position order, into the exact
incremental/decremental solvers of a :class:`~sv_attention.hf.cache_solvers.SolverBank` (the same bank
the certified cache maintains); the gate of boundary ``s`` is read off the solvers once they hold exactly
the keys at positions ``[0, s)``. No gradient.
"""

from __future__ import annotations

import torch

ExactSolvers = tuple[object, list[int]]  # (SolverBank, keys ingested per sequence)


def exact_gates(keys_by_position: torch.Tensor, lengths: torch.Tensor, sigma: torch.Tensor, C: float,
                todo: list[tuple[int, int, torch.Tensor]], state=None,
                ) -> tuple[dict[tuple[int, int], torch.Tensor], ExactSolvers]:
    """Gates of the (boundary, sequences) pairs of ``todo`` from fp64 maintained solvers.

    Parameters
    ----------
    keys_by_position : Tensor ``[b, g, P, d]``
    lengths : long Tensor ``[b]``  keys per sequence (a sequence shorter than ``s`` never requests ``s``)
    sigma : Tensor ``[b, g]``  bandwidth
    C : float  the fixed box
    todo : list of ``(boundary index, s, sequences [m])``
    state : GateState or None  holds the solvers between calls (decoding); ``state.exact`` is reused when
        it has not streamed past a requested boundary

    Returns
    -------
    fitted : dict ``(index, s) -> Tensor [m, g, s]`` (float64)
    solvers : the bank and the number of keys streamed into each sequence's solvers (for the state)
    """
    from sv_attention.hf.cache_solvers import SolverBank

    b, g = keys_by_position.shape[:2]
    sig = sigma.detach().to("cpu", torch.float64).numpy()
    if state is not None and state.exact is not None:
        bank, ingested = state.exact, list(state.exact_ingested)
    else:
        bank, ingested = SolverBank.empty(C, b, g), [0] * b
    fitted: dict[tuple[int, int], torch.Tensor] = {}
    for i, s, rows in sorted(todo, key=lambda t: t[1]):
        out = torch.zeros(len(rows), g, s, dtype=torch.float64)
        for r, row in enumerate(rows.tolist()):
            if ingested[row] > s or not bank.started(row):  # restart the sequence's solvers
                bank.start_row(row, sig[row], s)
                bank.row_history[row] = set()
                ingested[row] = 0
            lo = ingested[row]
            if s > lo:
                bank.admit(keys_by_position[:, :, lo:s], list(range(lo, s)), rows=[row])
                ingested[row] = s
            for j, solver in enumerate(bank.solvers[row]):
                ids = torch.as_tensor(solver.ids, dtype=torch.long)
                out[r, j, ids] = torch.as_tensor(solver.alpha, dtype=torch.float64)
        fitted[(i, s)] = out.to(keys_by_position.device)
    return fitted, (bank, ingested)
