"""The gate's exact path (ops/sv_gate/exact.py): the solver bank, and the certified cache as its caller, equal
the naive reference (``exact_gate`` per boundary on a sequence's real keys) for random, clustered and duplicate
keys, unpadded and left-padded with pad counts 1, chunk - 1, chunk, chunk + 3, in prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sv_attention.hf.cache import CertifiedCache
from sv_attention.hf.gate_handoff import clear_pending_gates, pop_pending_gate
from sv_attention.ops.settings import SVSettings, warmup_size
from sv_attention.ops.sv_gate.exact import BankCertificate, SolverBank, exact_gates
from sv_attention.ops.sv_gate.naive import exact_gate, median_distance
from sv_attention.ops.sv_gate.schedule import boundary_of, is_gated

CHUNK = 6
PADS = [0, 1, CHUNK - 1, CHUNK, CHUNK + 3]
KINDS = ["random", "clustered", "duplicate"]


def keys_of(kind: str, b: int, g: int, n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Keys ``[b, g, n, d]`` (fp64); "duplicate" repeats the first half exactly."""
    k = torch.randn(b, g, n, d, generator=gen, dtype=torch.float64)
    if kind == "clustered":
        k = 0.05 * k + torch.randn(b, g, n, 1, generator=gen, dtype=torch.float64).sign()
    elif kind == "duplicate":
        k[:, :, n // 2:] = k[:, :, : n - n // 2]
    return k


def reference_weights(real_keys: np.ndarray, C: float, chunk: int, sigma: float | None = None) -> np.ndarray:
    """The gate every query of one sequence reads, ``[n queries, n keys]``, from the naive reference: query ``t``
    reads ``exact_gate`` of the keys before its boundary (gated boundaries), 1 on the rest."""
    n = real_keys.shape[0]
    sig = median_distance(real_keys[:chunk]) if sigma is None else sigma
    out = np.ones((n, n))
    gates: dict[int, np.ndarray] = {}
    for t in range(n):
        s = boundary_of(t, chunk)
        if is_gated(s, chunk, warmup_size(C)):
            if s not in gates:
                gates[s] = exact_gate(real_keys[:s], C, sig)
            out[t, :s] = gates[s]
    return out


def _padded(kind: str, pads: list[int], L: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``i``: ``pads[i]`` junk keys (masked), then ``L - pads[i]`` real keys: keys ``[b, 2, L, 3]``, mask
    ``[b, L]``."""
    real = keys_of(kind, len(pads), 2, L, 3, gen)
    keys = torch.randn(len(pads), 2, L, 3, generator=gen, dtype=torch.float64)
    mask = torch.zeros(len(pads), L, dtype=torch.long)
    for i, p in enumerate(pads):
        keys[i, :, p:] = real[i, :, : L - p]
        mask[i, p:] = 1
    return keys, mask


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pad", PADS)
def test_cache_gate_equals_the_reference_for_any_pad_count(kind: str, pad: int) -> None:
    """Row 0 is left-padded by ``pad``, row 1 by nothing: each row's deposited gate equals the reference on its
    own real keys, in one prefill and token by token."""
    gen = torch.Generator().manual_seed(10 * len(kind) + pad)
    L = 4 * CHUNK + 2 + pad
    keys, mask = _padded(kind, [pad, 0], L, gen)
    settings = SVSettings(chunk=CHUNK, nu=0.5, n0=CHUNK)
    for mode in ("prefill", "decode"):
        cache = CertifiedCache(num_layers=1, nu=0.5, n0=CHUNK, chunk=CHUNK)
        cache.set_padding(mask)
        if mode == "prefill":
            cache.update(keys, keys.clone(), 0)
            w = pop_pending_gate(0).weights
        else:
            rows = []
            for t in range(L):
                cache.update(keys[:, :, t:t + 1], keys[:, :, t:t + 1].clone(), 0)
                g = pop_pending_gate(0)
                assert g.key_positions.tolist() == list(range(t + 1))
                rows.append(g.weights[:, :, 0])  # [b, h, t + 1]
            w = torch.zeros(2, 2, L, L, dtype=torch.float64)
            for t, r in enumerate(rows):
                w[:, :, t, : t + 1] = r
        for i in range(2):
            real = np.flatnonzero(mask[i].numpy())
            for j in range(2):
                ref = reference_weights(keys[i, j, real].numpy(), settings.box, CHUNK)
                got = w[i, j][real][:, real].numpy()
                got = np.where(np.tril(np.ones_like(got)) > 0, got, 1.0)  # causal part only (decode has no future)
                ref = np.where(np.tril(np.ones_like(ref)) > 0, ref, 1.0)
                assert np.abs(got - ref).max() <= 1e-9, (mode, i, j)
        for i in range(2):  # the row's bandwidth is the schedule's: median distance of its first chunk of real keys
            real = np.flatnonzero(mask[i].numpy())
            for j in range(2):
                sig = median_distance(keys[i, j, real[:CHUNK]].numpy())
                assert abs(cache.layers[0].bank.sigma[i, j] - sig) <= 1e-12
                assert {int(p) for p in cache.layers[0].bank.row_history[i]} <= set(real.tolist())  # no pad admitted
        clear_pending_gates()


def test_exact_gates_and_the_bank_equal_the_reference() -> None:
    """The ``solver="exact"`` streamer: each requested boundary's gate is the reference's."""
    gen = torch.Generator().manual_seed(1)
    kbp = keys_of("clustered", 2, 2, 20, 3, gen)
    C, sigma = 1.0 / 3.0, torch.full((2, 2), 1.5, dtype=torch.float64)
    todo = [(0, 6, torch.tensor([0, 1])), (1, 12, torch.tensor([0, 1])), (2, 18, torch.tensor([1]))]
    fitted, (bank, ingested) = exact_gates(kbp, torch.tensor([20, 20]), sigma, C, todo)
    assert isinstance(bank, SolverBank) and ingested == [12, 18]
    for idx, s, rows in todo:
        for r, row in enumerate(rows.tolist()):
            for j in range(2):
                ref = exact_gate(kbp[row, j, :s].numpy(), C, 1.5)
                assert np.abs(fitted[idx, s][r, j].numpy() - ref).max() <= 1e-10


def test_the_bank_certifies_with_a_dataclass_and_keeps_rows_apart() -> None:
    gen = torch.Generator().manual_seed(2)
    C = 0.25
    bank = SolverBank.empty(C, 2, 1)
    assert bank.warmup_size == warmup_size(C) == 6
    cert = bank.certified()
    assert isinstance(cert, BankCertificate) and not cert.certified and "warm-up" in cert.reason
    keys = keys_of("random", 1, 1, 10, 2, gen)[0].numpy()  # [1, 10, 2]
    bank.start_row(0, np.array([1.0]), 6)
    bank.admit_row(0, keys[:, :5], np.arange(5))
    assert not bank.certified().certified  # 5 admitted keys < warm-up 6
    bank.admit_row(0, keys[:, 5:], np.arange(5, 10))
    cert = bank.certified()
    assert cert.certified and cert.kkt_max < 1e-9 and "rows in warm-up" in cert.reason  # row 1 not started
    assert bank.started(0) and not bank.started(1) and bank.row_history[1] == set()
    np.testing.assert_array_equal(bank.alpha_row(1, 10), np.ones((1, 10)))  # ungated: weight 1
    np.testing.assert_allclose(bank.alpha_row(0, 10)[0], exact_gate(keys[0], C, 1.0), atol=1e-10)
    bank.clear_row(0)
    assert not bank.started(0) and bank.row_history[0] == set() and not bank.certified().certified


def test_the_old_import_path_re_exports_the_bank() -> None:
    from sv_attention.hf import cache_solvers
    from sv_attention.ops.sv_gate import exact

    assert cache_solvers.SolverBank is exact.SolverBank
    assert cache_solvers.BankAdmission is exact.BankAdmission
    assert cache_solvers.BankCertificate is exact.BankCertificate
