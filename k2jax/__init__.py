"""k2jax: Kimi K2 (MLA + ultra-sparse MoE, MuonClip) in JAX."""

__version__ = "0.1.0"
