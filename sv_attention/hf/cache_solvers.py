"""Moved: the solver bank lives in :mod:`sv_attention.ops.sv_gate.exact` (the gate's exact path).

This module re-exports :class:`SolverBank`, :class:`BankAdmission` and :class:`BankCertificate` for one
release; import them from ``sv_attention.ops.sv_gate.exact``.
"""

from __future__ import annotations

from sv_attention.ops.sv_gate.exact import BankAdmission, BankCertificate, SolverBank

__all__ = ["BankAdmission", "BankCertificate", "SolverBank"]
