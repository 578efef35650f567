"""The "published vs this implementation" table of the experiments: see :mod:`sv_attention.published`.

The rows are built in :mod:`sv_attention.published` (below the experiments and the artifact layers, so the
card and README renderers read them without importing the experiments); this module keeps the
experiments' entry point: ``python -m sv_attention.experiments.summary`` prints the full table.
"""

from __future__ import annotations

from sv_attention.published import ORDER, experiment_table_rows, render_markdown, rows_for

__all__ = ["ORDER", "experiment_table_rows", "render_markdown", "rows_for"]

if __name__ == "__main__":  # pragma: no cover - `python -m sv_attention.experiments.summary`
    print(render_markdown(experiment_table_rows()), end="")
