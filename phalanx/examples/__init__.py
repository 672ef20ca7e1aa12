"""Sample programs that run as ranks of a Phalanx gang (see :mod:`phalanx.examples.count_steps`)."""
