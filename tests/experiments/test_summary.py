import json

from sv_attention.experiments.summary import experiment_table_rows, render_markdown
from sv_attention.results import write_result


def test_rows_from_tables_and_from_published_mappings(tmp_path):
    write_result("secret", {"table": [{"metric": "m|1", "published": 0.8, "ours": 0.75}]},
                 tmp_path / "secret.json", command="sv-attention reproduce secret")
    write_result("other", {"published": {"a": {"b": 0.5}, "c": 1.0, "e": 0.9}, "a": {"b": 0.25}, "summary": {},
                           "e": {"rare": 0.85, "all": 0.9, "label": "x"}},
                 tmp_path / "other.json", command="x")
    (tmp_path / "broken.json").write_text("{not json")
    rows = experiment_table_rows(tmp_path)
    assert rows[0] == {"experiment": "secret", "metric": "m|1", "published": 0.8, "ours": 0.75,
                       "command": "sv-attention reproduce secret", "note": ""}
    other = {r["metric"]: r for r in rows if r["experiment"] == "other"}
    assert other["a.b"]["ours"] == 0.25 and other["c"]["ours"] is None
    assert other["e"]["ours"] == "rare=0.85, all=0.9"
    assert any(r["metric"] == "unreadable result file" for r in rows)
    md = render_markdown(rows)
    assert "m\\|1" in md and md.count("\n") == len(rows) + 2


def test_missing_directory_gives_no_rows(tmp_path):
    assert experiment_table_rows(tmp_path / "nope") == []
    json.dumps(experiment_table_rows())  # the repository's own results are JSON-serialisable rows


def test_published_numbers_at_other_paths_are_paired_with_their_measurement():
    from sv_attention.published import headline_rows

    rows = {(r["experiment"], r["metric"]): r for r in experiment_table_rows()}
    for (name, metric), r in rows.items():
        if name in ("bench_ceq", "forgetting", "sign_flip"):
            assert r["ours"] is not None, (name, metric)
    ceq = next(r for (n, _m), r in rows.items() if n == "bench_ceq" and "wall time" in r["metric"])
    assert ceq["met"] is False and "CPU product floor" in ceq["note"] and ceq["published"] == 1.32
    assert all(r["ours"] is not None for r in headline_rows())
