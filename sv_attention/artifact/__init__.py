"""sv_attention.artifact"""
