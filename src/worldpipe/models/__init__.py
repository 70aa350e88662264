"""worldpipe.models"""
