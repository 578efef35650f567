"""Deprecated location (kept for one release): the sign-flip study is not an operator; it lives in
:mod:`sv_attention.experiments.sign_flip`."""

from __future__ import annotations

from sv_attention.experiments.sign_flip import *  # noqa: F403
from sv_attention.experiments.sign_flip import __all__  # noqa: F401
