"""phalanx: elastic, fault-tolerant training and RL post-training."""

__version__ = "0.1.0"
