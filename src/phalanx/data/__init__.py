"""Exactly-once elastic data: a sampler driven by a global cursor that advances on commit."""
