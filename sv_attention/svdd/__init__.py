"""sv_attention.svdd"""
