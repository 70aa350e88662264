"""worldpipe.measure"""
