"""The base layer: atomic durable writes, error base classes, canonical hashing, locations, provenance.

Imports nothing else of worldpipe; every other room may import it."""
