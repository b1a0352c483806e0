"""Pieces shared by the forward (``gdn_fwd``) and backward (``gdn_bwd``) TileLang kernels."""
