"""sv_attention.ops"""
