"""Test and benchmark helpers that ship with Phalanx (like a framework's `testing` package)."""
