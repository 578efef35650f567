"""The window rule (ops/sv_gate/schedule.py): sliding-window visibility, the gate equals the naive reference;
a window covering every earlier key is exactly the full-attention gate; decode == prefill."""

from __future__ import annotations

import pytest
import torch

from sv_attention.ops.settings import SVSettings
from sv_attention.ops.sv_gate import naive_sv_gate_attention, sv_gate_attention
from sv_attention.ops.sv_gate.schedule import GateSchedule

CHUNK = 4
SETTINGS = SVSettings(chunk=CHUNK, nu=0.5)


def windowed(b: int, n: int, window: int, pad: int = 0) -> torch.Tensor:
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    vis = (j <= i) & (j > i - window) & (j >= pad)
    return vis[None].expand(b, n, n).clone()


def data(b=2, h=4, g=2, n=22, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return mk(b, h, n, d), mk(b, g, n, d), mk(b, g, n, d)


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("window", [5, 9, 13])
@pytest.mark.parametrize("pad", [0, 3])
def test_window_smaller_than_the_prompt_equals_naive(window, pad):
    q, k, v = data()
    vis = windowed(2, 22, window, pad)
    vis[1] = windowed(1, 22, window)[0]  # row 1 unpadded
    out = sv_gate_attention(q, k, v, vis, SETTINGS).out
    ref = naive_sv_gate_attention(q, k, v, vis, SETTINGS)
    assert rel(out, ref) <= 1e-7
    sched = GateSchedule.from_visible(vis, SETTINGS)
    assert bool(sched.windowed.any())  # the window rule is exercised
    plain = naive_sv_gate_attention(q, k, v, vis, SETTINGS.replace(gated=False))
    assert rel(out, plain) > 1e-3  # and gated, not softmax


def test_window_covering_every_key_is_the_full_gate_bitwise():
    q, k, v = data()
    full = torch.tril(torch.ones(22, 22, dtype=torch.bool))[None].expand(2, 22, 22)
    a = sv_gate_attention(q, k, v, windowed(2, 22, 22), SETTINGS).out
    b = sv_gate_attention(q, k, v, full, SETTINGS).out
    assert torch.equal(a, b)


def test_schedule_positions_under_a_window():
    vis = windowed(1, 12, 5, pad=2)
    s = GateSchedule.from_visible(vis, SETTINGS)
    assert s.query_position[0].tolist() == [-1, -1] + list(range(10))
    assert s.start[0, 2:].tolist() == [max(0, t - 4) for t in range(10)]
    # a decode step whose cache kept only the window: 3 valid keys dropped before column 0
    step = torch.ones(1, 1, 5, dtype=torch.bool)
    s2 = GateSchedule.from_visible(step, SETTINGS, base=torch.tensor([3]))
    assert s2.query_position.tolist() == [[7]] and s2.start.tolist() == [[3]]


def test_decode_with_a_rolling_window_equals_prefill():
    """Each query alone, with only its window's keys (what a sliding cache holds) and the count of keys
    dropped before them, equals its prefill row."""
    q, k, v = data(b=1, n=20)
    W = 7
    full = sv_gate_attention(q, k, v, windowed(1, 20, W), SETTINGS).out
    for t in range(20):
        lo = max(0, t - W + 1)
        step = sv_gate_attention(q[:, :, t:t + 1], k[:, :, lo:t + 1], v[:, :, lo:t + 1],
                                 torch.ones(1, 1, t + 1 - lo, dtype=torch.bool), SETTINGS,
                                 base=torch.tensor([lo])).out
        assert rel(step, full[:, :, t:t + 1]) <= 1e-9, t
