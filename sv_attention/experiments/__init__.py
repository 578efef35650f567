"""The paper's experiments, one module per experiment (the ``sv-attention reproduce NAME`` commands).

Each module exposes ``run_<name>(...) -> dict``: a JSON-ready payload with ``protocol`` (the exact
procedure in words), ``parameters``, ``seeds``, raw per-trial values under ``trials``, a ``summary``,
the paper's numbers under ``published`` and a ``table`` of ``{metric, published, ours}`` rows that
:mod:`sv_attention.experiments.summary` turns into the model card's "published vs this implementation"
table. :mod:`sv_attention.experiments.figures` draws each payload as a PNG.
"""
