"""worldpipe.data"""
