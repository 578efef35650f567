"""The visibility summary read once per mask (sv_attention.ops.sv_gate.visibility)."""

from __future__ import annotations

import pytest
import torch

from sv_attention.ops.sv_gate import visibility
from sv_attention.ops.sv_gate.visibility import summarize


def _direct(visible: torch.Tensor) -> dict:
    """The summaries computed the plain way, row by row."""
    b, q, kv = visible.shape
    first = torch.zeros(b, q, dtype=torch.long)
    last = torch.zeros(b, q, dtype=torch.long)
    for i in range(b):
        for r in range(q):
            cols = visible[i, r].nonzero().flatten()
            if len(cols):
                first[i, r], last[i, r] = cols[0], cols[-1]
    tri = torch.ones(q, kv, dtype=torch.bool).tril()
    return {"valid": visible.any(1), "seen": visible.any(-1), "first": first, "last": last,
            "all_visible": bool(visible.all()), "plain_causal": q == kv and bool((visible == tri).all())}


def _masks() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    b, n = 3, 9
    causal = torch.ones(n, n, dtype=torch.bool).tril().expand(b, n, n)
    padded = causal & (torch.arange(n) >= torch.tensor([0, 2, 4])[:, None])[:, None, :]
    window = causal & ~torch.ones(n, n, dtype=torch.bool).tril(-4)
    causal16 = torch.ones(16, 16, dtype=torch.bool).tril().expand(2, 16, 16).contiguous()  # compared as words
    edited16 = causal16.clone()
    edited16[1, 9, 3] = False
    shifted = torch.zeros(3 + 2 * 16 * 16, dtype=torch.bool)[3:].view(2, 16, 16)  # contiguous, odd offset
    shifted.copy_(causal16)
    return {"causal": causal, "causal16": causal16, "edited16": edited16, "shifted16": shifted, "padded": padded.clone(), "window": window.clone(),
            "random": torch.rand(b, 5, 7, generator=gen) < 0.4, "all": torch.ones(b, 4, 6, dtype=torch.bool),
            "decode": torch.ones(b, 1, 6, dtype=torch.bool)}


@pytest.mark.parametrize("name", list(_masks()))
def test_the_summary_equals_the_row_by_row_reading(name):
    """valid / seen / first / last (where a row sees a key) and the two flags match a plain reading."""
    visible = _masks()[name]
    got, want = summarize(visible), _direct(visible)
    assert torch.equal(got.valid, want["valid"]) and torch.equal(got.seen, want["seen"])
    assert torch.equal(got.first[want["seen"]], want["first"][want["seen"]])
    assert torch.equal(got.last[want["seen"]], want["last"][want["seen"]])
    assert got.all_visible == want["all_visible"] and got.plain_causal == want["plain_causal"]


def test_the_summary_is_remembered_per_mask_and_read_again_after_an_edit(monkeypatch):
    """Views of one mask share one reading; an in-place edit (through any view) or another mask is read
    afresh, and the answer follows the edit."""
    reads = []
    real = visibility._read
    monkeypatch.setattr(visibility, "_read", lambda v: reads.append(1) or real(v))
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None, None].expand(2, 1, 8, 8).clone()
    first = summarize(mask[:, 0])
    again = summarize(mask[:, 0])  # another view object of the same memory
    assert again is first and len(reads) == 1 and first.plain_causal
    mask[1, 0, 5, 2] = False  # an in-place edit bumps the shared version counter
    edited = summarize(mask[:, 0])
    assert len(reads) == 2 and not edited.plain_causal
    other = mask.clone()
    summarize(other[:, 0])
    assert len(reads) == 3


def test_inference_tensors_are_read_every_time(monkeypatch):
    """An inference-mode tensor has no version counter: never remembered."""
    reads = []
    real = visibility._read
    monkeypatch.setattr(visibility, "_read", lambda v: reads.append(1) or real(v))
    with torch.inference_mode():
        mask = torch.ones(1, 4, 4, dtype=torch.bool).tril()
        summarize(mask)
        summarize(mask)
    assert len(reads) == 2
