"""worldpipe.parallel"""
