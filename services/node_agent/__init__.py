"""Phalanx node agent: reports a host's GPU topology to the scheduler and runs the ranks it is assigned.

Kept import-light: the rank wrapper (services.node_agent.rank_wrapper) is started once per rank.
"""
