"""Analyses of trained models that are neither operators nor studies (above ``ops/``, beside ``experiments/``).

- :mod:`~sv_attention.analysis.beta_test`: the smprime beta likelihood-ratio test (per layer and joint,
  with a Wald cross-check) and the per-layer gradient census.
"""
