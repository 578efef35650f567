"""The sv_lm model refuses inputs with nothing to read (an empty prompt, an all-padding row) with a typed error."""

from __future__ import annotations

import logging

import pytest
import torch

from configuration_sv import SVConfig
from modeling_sv import SVForCausalLM, backend_summary
from sv_attention.errors import InvalidHyperparameterError, InvalidInputError
from tokenization_sv import SVByteTokenizer

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=48)


def tiny(operator="sv", knobs=None):
    torch.manual_seed(0)
    if operator == "sv" and knobs is None:
        knobs = {"chunk": 4, "nu": 0.5, "n0": 8}
    return SVForCausalLM(SVConfig(operator=operator, operator_config=knobs, **TINY)).eval()


@pytest.mark.parametrize("operator", ["sv", "ceq", "softmax", "smprime"])
def test_empty_prompt_to_generate(operator):
    model = tiny(operator)
    with pytest.raises(InvalidInputError, match="empty input: no tokens"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3, do_sample=False)
    with pytest.raises(InvalidInputError, match="empty input"):
        model(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(InvalidInputError, match="empty input"):
        model(inputs_embeds=torch.zeros(1, 0, 32))


def test_empty_prompt_through_the_tokenizer():
    model, tok = tiny(), SVByteTokenizer()
    batch = tok("", return_tensors="pt")
    assert batch["input_ids"].shape == (1, 0)
    with pytest.raises(InvalidInputError, match="empty input"):
        model.generate(**batch, max_new_tokens=2, do_sample=False)


def test_all_padding_row_is_named():
    model, tok = tiny(), SVByteTokenizer()
    batch = tok(["Once upon", ""], padding=True, return_tensors="pt")
    assert batch["attention_mask"][1].sum() == 0
    with pytest.raises(InvalidInputError, match=r"row\(s\) \[1\] have no real token"):
        model(**batch)
    with pytest.raises(InvalidInputError, match=r"row\(s\) \[1\]"):
        model.generate(**batch, max_new_tokens=2, do_sample=False)
    mask = torch.tensor([[0, 0, 0], [0, 0, 0], [1, 1, 1]])
    with pytest.raises(InvalidInputError, match=r"row\(s\) \[0, 1\]"):
        model(torch.ones(3, 3, dtype=torch.long), attention_mask=mask)


def test_valid_padding_still_runs_and_equals_the_unpadded_row():
    model = tiny()
    ids = torch.tensor([[0, 0, 7, 8, 9], [5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
        alone = model(ids[:1, 2:]).logits
    torch.testing.assert_close(out[0, 2:], alone[0], rtol=1e-5, atol=1e-5)


def test_backend_summary_is_one_line_per_model(caplog):
    with caplog.at_level(logging.INFO, logger="modeling_sv"):
        tiny("sv")
        tiny("ceq")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sv_lm:")]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert lines[0].startswith("sv_lm: operator 'sv', gate solver 'batched', partition finder ")
    assert lines[1] == "sv_lm: operator 'ceq' (torch)"
    exact = SVConfig(operator="sv", operator_config={"solver": "exact", "chunk": 4, "n0": 8}, **TINY)
    assert "gate solver 'exact' (fp64 maintained solvers, numpy" in backend_summary(exact)


def test_config_version_parse_without_packaging(monkeypatch):
    import builtins

    import configuration_sv

    real_import = builtins.__import__

    def no_packaging(name, *args, **kwargs):
        if name.startswith("packaging"):
            raise ImportError("No module named 'packaging'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_packaging)
    assert configuration_sv._series("0.1.0") == (0, 1)
    assert configuration_sv._series("1.4.2rc1") == (1,)
    with pytest.raises(Exception, match="unparseable"):
        configuration_sv._series("banana")
    assert issubclass(InvalidHyperparameterError, InvalidInputError)
