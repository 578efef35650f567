"""The reference of the SV-gated attention: plain loops, every boundary fitted by the exact solver.

This is the obviously-correct version every path of the gate is tested against (the plug-in's prefill
and decode, the model's forward and generate, the certified cache, ``CausalSVAttention``): outputs and
gradients w.r.t. ``query``, ``key`` and ``value``. It follows DESIGN §2.1 / §2.5 directly:

- positions count the valid keys of each sequence (a key is valid when some query may attend it);
- a query's position ``t`` is the position of the last key it sees, ``a`` that of the first one (0 unless a
  sliding window hides the oldest keys); it reads boundary ``s = chunk * floor(t / chunk)`` and is gated when
  ``s >= chunk`` and ``s - a >= ceil(1/C) + 2``;
- its gate is the SVDD optimum on the keys at positions ``[a, s)`` (the window rule of
  :mod:`sv_attention.ops.sv_gate.schedule`; ``[0, s)`` without a window) from a fresh fp64
  :class:`~sv_attention.svdd.IncrementalSVDD` (box ``C`` fixed, bandwidth ``sigma`` or the lower median
  of the pairwise distances of the keys at positions ``[a, min(a + chunk, s))``);
- weights ``exp(scale q.k_j)`` over the visible keys, times ``alpha_j`` for keys in ``[a, s)``, normalised.

With ``settings.detach_gate=False`` the gate is differentiated too, by the paper's implicit VJP
(:func:`differentiable_exact_gate`): the reference of the trainable path's gradient.

Slow by design: use it on a few dozen keys.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sv_attention.ops.settings import SVSettings
from sv_attention.svdd import IncrementalSVDD
from sv_attention.svdd.box import warmup_size


def median_distance(keys: np.ndarray) -> float:
    """Lower median of the pairwise distances ``||x_i - x_j||``, ``i < j`` (1.0 for fewer than two keys or
    all distances 0)."""
    dists = sorted(math.sqrt(float(((keys[i] - keys[j]) ** 2).sum()))
                   for i in range(len(keys)) for j in range(i + 1, len(keys)))
    if not dists:
        return 1.0
    med = dists[(len(dists) - 1) // 2]
    return med if med > 0 else 1.0


def exact_gate(keys: np.ndarray, C: float, sigma: float) -> np.ndarray:
    """SVDD coefficients ``[n]`` of ``keys [n, d]`` from a fresh exact solver."""
    solver = IncrementalSVDD(C, sigma)
    solver.add(keys, ids=list(range(len(keys))))
    out = np.zeros(len(keys))
    out[solver.ids] = solver.alpha
    return out


def differentiable_exact_gate(keys: torch.Tensor, C: float, sigma: float) -> torch.Tensor:
    """:func:`exact_gate` as a function of ``keys [n, d]`` (float64, may require grad): the exact solver's
    coefficients, differentiated by the paper's implicit VJP within their partition
    (:func:`sv_attention.svdd.implicit.svdd_alpha_rho`, DESIGN §2.3). An empty margin set makes alpha locally
    constant: then the coefficients are returned without a gradient."""
    from sv_attention.svdd.implicit import svdd_alpha_rho

    solver = IncrementalSVDD(C, sigma)
    solver.add(keys.detach().cpu().numpy(), ids=list(range(len(keys))))
    if not solver.margin_inverse[0].size:
        return torch.as_tensor(exact_gate(keys.detach().cpu().numpy(), C, sigma), dtype=keys.dtype)
    alpha, _ = svdd_alpha_rho(keys, solver)
    return alpha


def naive_sv_gate_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                            settings: SVSettings, *, scaling: float | None = None, causal: bool = True,
                            ) -> torch.Tensor:
    """Reference SV-gated attention, ``[b, h, q, dv]`` (rows with no visible key are 0).

    Parameters
    ----------
    query : Tensor ``[b, h, q, d]``; key, value : Tensor ``[b, g, kv, d]``
    visible : bool Tensor ``[b, q, kv]``
    settings : SVSettings  (``gated``, ``C`` / ``nu`` / ``n0``, ``chunk``, ``sigma``, ``gate_floor``)
    scaling : float or None
    causal : bool  False: one gate on all valid keys, read by every query
    """
    b, h, q, d = query.shape
    g, kv = key.shape[1], key.shape[2]
    group = h // g
    sc = d ** -0.5 if scaling is None else float(scaling)
    C, chunk = settings.box, settings.chunk
    warmup = warmup_size(C)
    rows = []
    for bi in range(b):
        cols = [j for j in range(kv) if bool(visible[bi, :, j].any())]  # valid keys, in position order
        position = {j: p for p, j in enumerate(cols)}
        heads = []
        for hi in range(h):
            gi = hi // group
            keys_np = key[bi, gi, cols].detach().double().cpu().numpy()
            live = not settings.detach_gate and key.requires_grad
            gates: dict[tuple[int, int], torch.Tensor] = {}
            outs = []
            for i in range(q):
                seen = [j for j in range(kv) if bool(visible[bi, i, j])]
                if not seen:
                    outs.append(torch.zeros_like(value[bi, gi, 0]))
                    continue
                t = position[seen[-1]] if causal else len(cols) - 1  # the query's position
                a = position[seen[0]] if causal else 0  # its first visible key (> 0 under a sliding window)
                s = chunk * (t // chunk) if causal else len(cols)
                gated = settings.gated and (s - a >= warmup) and (s >= chunk or not causal)
                logits = torch.stack([(query[bi, hi, i] * key[bi, gi, j]).sum() * sc for j in seen])
                weight = torch.exp(logits - logits.max())
                if gated:
                    if (a, s) not in gates:
                        if settings.sigma is not None:
                            sigma = settings.sigma
                        else:
                            sigma = median_distance(keys_np if not causal else keys_np[a:min(a + chunk, s)])
                        gates[a, s] = (differentiable_exact_gate(key[bi, gi, cols[a:s]].double(), C, sigma) if live
                                       else torch.as_tensor(exact_gate(keys_np[a:s], C, sigma)))
                    ones = torch.ones((), dtype=weight.dtype)
                    mult = torch.stack([gates[a, s][position[j] - a].to(weight.dtype).clamp_min(settings.gate_floor)
                                        if a <= position[j] < s else ones for j in seen])
                    weight = weight * mult
                weight = weight / weight.sum()
                outs.append((weight[:, None] * value[bi, gi, seen]).sum(0))
            heads.append(torch.stack(outs))
        rows.append(torch.stack(heads))
    return torch.stack(rows)
