"""One layer call of smprime with its decoding state (the entry point the remote-code model calls).

smprime's row i depends on every gate ``m_k`` / ``theta_k`` with ``k <= i``, so decoding keeps the gates
of the earlier positions (:class:`SMPrimeState`) and computes only the new rows, with the same function
and the same per-row operations as the prefill (O(s d) per decoded token: exact, not a recurrent state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sv_attention.errors import InvalidInputError
from sv_attention.ops.smprime.attention import smprime_attention
from sv_attention.ops.smprime.module import SMPrime


class SMPrimeState:
    """The gates ``m``, ``theta'`` ``[b, h, n]`` of one layer's cached positions.

    The batch / length hooks of a transformers ``Cache`` (:meth:`crop`, :meth:`reorder`,
    :meth:`batch_select_indices`, :meth:`batch_repeat_interleave`, :meth:`reset`) keep it in step with the
    key/value cache it mirrors.
    """

    def __init__(self) -> None:
        self.m: torch.Tensor | None = None
        self.theta: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.m is None else int(self.m.shape[-1])

    @property
    def batch(self) -> int | None:
        return None if self.m is None else int(self.m.shape[0])

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"SMPrimeState(length={self.length}, batch={self.batch})"

    def reset(self) -> None:
        """Forget everything (the next call must be a prefill)."""
        self.m = self.theta = None

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (negative: drop that many from the end)."""
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise InvalidInputError(f"crop length must be an int, got {max_length!r}")
        n = self.length + max_length if max_length < 0 else max_length
        if n < 0:
            raise InvalidInputError(f"cannot crop {-max_length} positions from a cache of length {self.length}")
        if n == 0:
            self.reset()
        elif n < self.length:
            self.m, self.theta = self.m[..., :n], self.theta[..., :n]

    def reorder(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search): row r becomes old row ``beam_idx[r]``."""
        if self.m is not None:
            idx = torch.as_tensor(beam_idx, dtype=torch.long, device=self.m.device)
            self.m, self.theta = self.m.index_select(0, idx), self.theta.index_select(0, idx)

    reorder_cache = reorder

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices``."""
        self.reorder(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times."""
        if self.m is not None:
            self.m, self.theta = self.m.repeat_interleave(repeats, 0), self.theta.repeat_interleave(repeats, 0)


@dataclass
class SMPrimeLayerResult:
    """Result of :func:`smprime_layer_attention`: ``out [b, h, q, dv]`` and the state (None when not kept)."""

    out: torch.Tensor
    state: SMPrimeState | None


def smprime_layer_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                            sm: SMPrime, hidden_states: torch.Tensor, *, scaling: float | None = None,
                            state: SMPrimeState | None = None, keep_state: bool = False) -> SMPrimeLayerResult:
    """smprime for one attention layer, prefill or decoding, with the layer's gate history.

    Parameters
    ----------
    query : Tensor ``[b, h, q_len, d]``  the last ``q_len`` positions
    key, value : Tensor ``[b, h_kv, kv_len, d]``  every cached position plus the new ones
    mask : None or anything :func:`sv_attention.ops.masking.to_bool_mask` accepts (causality j <= i is
        applied on top); an all-True mask is dropped
    sm : SMPrime  the layer's scalars and gate heads
    hidden_states : Tensor ``[b, q_len, d_model]``  the layer input of the new positions (the gates' input)
    scaling : float, optional
    state : SMPrimeState or None
        The gates of the ``kv_len - q_len`` earlier positions (decoding); a prefill ignores it.
    keep_state : bool
        Keep the gates of every position: ``state`` (or a new one) is updated in place and returned.

    Returns
    -------
    SMPrimeLayerResult

    Raises
    ------
    InvalidInputError
        A decoding step whose state does not hold exactly the earlier positions of this batch; the state
        is left unchanged.
    """
    m, theta = sm.gates(hidden_states)
    b, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    past = kv_len - q_len
    if past > 0:
        if state is None or state.length != past or state.batch != b:
            held = 0 if state is None else state.length
            raise InvalidInputError(f"smprime state holds {held} positions, the call needs {past}; keep the state "
                                    "with the key/value cache (use SVLMCache) and reset them together")
        m = torch.cat([state.m, m], -1)
        theta = torch.cat([state.theta, theta], -1)
    if keep_state:
        state = state if state is not None else SMPrimeState()
        state.m, state.theta = m, theta
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and bool(mask.all()):
        mask = None
    out = smprime_attention(query, key, value, m.to(query.dtype), theta.to(query.dtype),
                            beta=sm.beta.to(query.dtype), qk=sm.qk.to(query.dtype), mask=mask, scaling=scaling)
    return SMPrimeLayerResult(out=out, state=state if keep_state else None)


__all__ = ["SMPrimeLayerResult", "SMPrimeState", "smprime_layer_attention"]
