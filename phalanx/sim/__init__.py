"""Phalanx cluster simulator: a discrete-event model of the scheduler, the fabric and the jobs."""
