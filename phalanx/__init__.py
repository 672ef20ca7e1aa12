"""Phalanx: a control plane for GPU clusters with atomic gang scheduling."""

__version__ = "0.1.0"
