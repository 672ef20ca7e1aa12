"""Shared by the services and the CLI: tokens (phalanx.common.tokens) and logging set-up (phalanx.common.logging).

Both may import this package; it imports neither.
"""
