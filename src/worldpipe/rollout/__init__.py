"""worldpipe.rollout: imagination rollouts, their sessions, batcher and result cache."""
