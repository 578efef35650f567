"""sv_attention.data"""
