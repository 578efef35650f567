"""Deprecated location (kept for one release): the beta test is not an operator; it lives in
:mod:`sv_attention.analysis.beta_test`."""

from __future__ import annotations

from sv_attention.analysis.beta_test import *  # noqa: F403
from sv_attention.analysis.beta_test import __all__  # noqa: F401
