"""Fleet simulator: cache-aware routing across N engine replicas and 1-8 bridges (see sim.py)."""
