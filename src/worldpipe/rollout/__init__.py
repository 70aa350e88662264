"""worldpipe.rollout"""
