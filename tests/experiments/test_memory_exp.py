from sv_attention.experiments.memory_exp import boilerplate_texts, run_memory
from tests.test_memory import bow_embed


def test_memory_experiment_smallest_setting_with_a_toy_embedder():
    # The real MiniLM run is `sv-attention reproduce memory`; tests/test_memory.py checks MiniLM answers.
    p = run_memory(embed=bow_embed, n_boilerplate=10, repeats=1, budget=4)
    s = p["summary"]
    assert s["forgotten_returns_no_record"] == 1.0
    assert s["answers_equal_never_saw"] == 1.0
    assert s["max_score_deviation_vs_never_saw"] < 1e-10
    assert s["certified_eviction_max_score_change"] < 1e-12
    for r in p["trials"]["boilerplate_eviction"]:
        # A support record is never evicted by the certified policy.
        assert r["kept_certified"] >= r["support_size"]
        assert r["rare_answer_certified"] == r["rare_answer_before_eviction"]
    assert len(set(boilerplate_texts())) == 60
