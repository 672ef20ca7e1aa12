"""Serving fleets: services of K replicas, each a gang, kept by the scheduler's service controller.

- `spec`: what a job may ask for serving (roles, start order, readiness probe, restart) and what a service spec
  must be, checked before anything is written (INVALID_ARGUMENT with every problem named);
- `controller`: the leader's reconcile loop: it turns each service's desired state (K replicas of its current
  revision, rollout bounds, the autoscaler's count) into replica jobs submitted and cancelled through the cycle,
  with the pure rollout plan of phalanx.core.rollout;
- `servicer`: the ServiceService gRPC API;
- `metrics`: the autoscaler's inputs, scraped from the ready leaders' Prometheus endpoints or pushed.
"""
