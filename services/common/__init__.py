"""Shared service plumbing: logging, gRPC server factory, metrics, error mapping."""
