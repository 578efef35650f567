import importlib

import pytest

import sv_attention.ops as ops
import sv_attention.svdd as svdd


@pytest.mark.parametrize("pkg", [ops, svdd])
def test_lazy_public_names_resolve_to_their_defining_module(pkg):
    for name, module in pkg._LAZY.items():
        obj = getattr(pkg, name)
        assert obj is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError):
        pkg.no_such_name  # noqa: B018


def test_top_level_lazy_names():
    import sv_attention

    assert sv_attention.IncrementalSVDD is svdd.IncrementalSVDD
    assert "CertifiedCache" in dir(sv_attention)
    with pytest.raises(AttributeError, match="sv_attention"):
        sv_attention.no_such_name  # noqa: B018
