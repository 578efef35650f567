"""sv_attention.train"""
