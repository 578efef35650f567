"""Registration: both names in AttentionInterface AND AttentionMaskInterface, idempotent, on import."""

from __future__ import annotations

import subprocess
import sys

from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import sv_attention
from sv_attention.hf import is_registered, register_all
from sv_attention.hf.attention import ceq_attention_forward, sv_attention_forward
from sv_attention.hf.masks import ceq_mask, sv_attention_mask


def test_import_registers_both_interfaces():
    assert is_registered("sv_attention") and is_registered("ceq")
    assert ALL_ATTENTION_FUNCTIONS["sv_attention"] is sv_attention_forward
    assert ALL_ATTENTION_FUNCTIONS["ceq"] is ceq_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["sv_attention"] is sv_attention_mask
    assert ALL_MASK_ATTENTION_FUNCTIONS["ceq"] is ceq_mask
    assert not is_registered("sdpa")


def test_register_all_is_idempotent():
    before = dict(ALL_ATTENTION_FUNCTIONS._global_mapping), dict(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping)
    assert register_all() == ["sv_attention", "ceq"]
    assert register_all() == ["sv_attention", "ceq"]
    assert (dict(ALL_ATTENTION_FUNCTIONS._global_mapping), dict(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping)) \
        == before


def test_fresh_process_import_registers_and_exposes_public_names():
    code = ("import sv_attention\n"
            "from transformers import AttentionInterface, AttentionMaskInterface\n"
            "assert 'sv_attention' in AttentionInterface._global_mapping and 'ceq' in AttentionInterface._global_mapping\n"
            "assert 'sv_attention' in AttentionMaskInterface._global_mapping\n"
            "assert 'ceq' in AttentionMaskInterface._global_mapping\n"
            "assert callable(sv_attention.enable)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_lazy_names():
    assert "enable" in dir(sv_attention) and "CertifiedCache" in dir(sv_attention)
    from sv_attention.hf.enable import enable

    assert sv_attention.enable is enable
