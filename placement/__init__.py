"""Request routing across engine replicas, GPU/MIG inventory and replica placement."""
