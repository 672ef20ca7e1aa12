"""`phalanx web`: the live dashboard (server.py) and its page (static/, shipped as is: no build step, nothing
fetched at run time)."""
