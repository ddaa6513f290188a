"""MuonClip and friends as optax transforms (report 2.1).

May import: k2jax.configs, k2jax.kernels, k2jax.model.
"""

from k2jax.optim.balancing import load_imbalance, router_bias_balancing
from k2jax.optim.master import MasterWeightsState, master_weights
from k2jax.optim.muon import (adamw, dimension_numbers, labels, muon, newton_schulz_flops, sgd,
                              scale_by_muon_in, scale_by_rms_match)
from k2jax.optim.muonclip import (OPTIMIZERS, learning_rate_schedule, muonclip, optimizer,
                                  validate)
from k2jax.optim.qk_clip import QKClipState, clip_factors, qk_clip
from k2jax.optim.schedules import wsd

__all__ = ["adamw", "muon", "muonclip", "sgd", "qk_clip", "QKClipState", "clip_factors", "wsd",
           "router_bias_balancing", "load_imbalance", "optimizer", "OPTIMIZERS", "validate",
           "learning_rate_schedule", "dimension_numbers", "labels", "scale_by_rms_match",
           "master_weights", "MasterWeightsState", "newton_schulz_flops", "scale_by_muon_in"]
