"""worldpipe.checkpoint"""
