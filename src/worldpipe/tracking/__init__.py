"""worldpipe.tracking"""
