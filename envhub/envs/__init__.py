"""Ready environments with deterministic graders in [0, 1]."""
