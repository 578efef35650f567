"""sv_attention.hf"""
