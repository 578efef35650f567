import pytest
import torch

from sv_attention.ops.sv_gate.readout import grouped_biased_sdpa


def plain(query, key, value, visible, bias, scaling):
    """Eager reference: logits + bias, -inf where not visible, softmax, rows with nothing visible 0."""
    b, h, q, d = query.shape
    g = key.shape[1]
    r = h // g
    k = key.repeat_interleave(r, 1)
    v = value.repeat_interleave(r, 1)
    logits = query @ k.transpose(-1, -2) * scaling
    if bias is not None:
        logits = logits + bias.repeat_interleave(r, 1)
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    w = torch.nan_to_num(torch.softmax(logits, -1), nan=0.0)
    return w @ v


@pytest.mark.parametrize("row_block", [3, 8, 1000])
@pytest.mark.parametrize("bias_rows", [None, 1, "q"])
def test_row_blocks_equal_the_eager_reference(row_block, bias_rows):
    gen = torch.Generator().manual_seed(row_block)
    b, h, g, q, kv, d = 2, 4, 2, 13, 17, 5
    query = torch.randn(b, h, q, d, generator=gen, dtype=torch.float64)
    key = torch.randn(b, g, kv, d, generator=gen, dtype=torch.float64)
    value = torch.randn(b, g, kv, 3, generator=gen, dtype=torch.float64)
    # causal over the last q columns, left padding of 3 keys in sequence 1, an empty row in sequence 1
    visible = torch.ones(q, kv, dtype=torch.bool).tril(kv - q).expand(b, q, kv).clone()
    visible[1, :, :3] = False
    visible[1, 0] = False
    bias = None
    if bias_rows is not None:
        bias = torch.randn(b, g, q if bias_rows == "q" else 1, kv, generator=gen, dtype=torch.float64)
        bias[0, 0, ..., 2] = float("-inf")  # a reserve key
    out = grouped_biased_sdpa(query, key, value, visible, bias, 0.4, row_block=row_block)
    ref = plain(query, key, value, visible, bias, 0.4)
    assert out.shape == (b, h, q, 3)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ref, atol=1e-12)
    assert (out[1, :, 0] == 0).all()


def test_a_factored_gate_bias_gives_the_dense_result():
    """grouped_biased_sdpa reads a GateBias block by block exactly as the dense bias it stands for."""
    from sv_attention.ops.sv_gate import GateBias

    gen = torch.Generator().manual_seed(7)
    b, h, g, q, d = 2, 4, 2, 12, 3
    table = torch.log(torch.rand(b, g, 3, q, generator=gen, dtype=torch.float64))
    table[:, :, 2] = 0.0  # the "ungated" slot
    table[0, 1, 0, 4] = float("-inf")  # a reserve key
    gb = GateBias(log_table=table, slot=torch.randint(0, 3, (b, q), generator=gen),
                  key_position=torch.arange(q).expand(b, q).contiguous())
    dense = gb.dense()
    assert dense.shape == gb.shape == (b, g, q, q)
    assert torch.equal(gb.rows(3, 7, 5), dense[:, :, 3:7, :5])
    query = torch.randn(b, h, q, d, generator=gen, dtype=torch.float64)
    key = torch.randn(b, g, q, d, generator=gen, dtype=torch.float64)
    value = torch.randn(b, g, q, d, generator=gen, dtype=torch.float64)
    visible = torch.ones(q, q, dtype=torch.bool).tril().expand(b, q, q)
    out = grouped_biased_sdpa(query, key, value, visible, gb, 0.5, row_block=5)
    assert torch.allclose(out, plain(query, key, value, visible, dense, 0.5), atol=1e-12)


def test_no_query_rows_and_degenerate_row_blocks():
    q = torch.randn(1, 2, 0, 3)
    k = torch.randn(1, 1, 4, 3)
    out = grouped_biased_sdpa(q, k, k, torch.zeros(1, 0, 4, dtype=torch.bool), None, 1.0)
    assert out.shape == (1, 2, 0, 3)
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    k = torch.randn(1, 1, 4, 3, dtype=torch.float64)
    vis = torch.ones(4, 4, dtype=torch.bool).tril()[None]
    ref = plain(q, k, k, vis, None, 1.0)
    for rb in (0, -3):  # treated as one row per block
        assert torch.allclose(grouped_biased_sdpa(q, k, k, vis, None, 1.0, row_block=rb), ref, atol=1e-12)
