"""The Phalanx services: scheduler, node agent and checkpoint coordinator, and what they share."""
