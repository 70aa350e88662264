"""Training configuration: group schemas, composition, run identity (hash, resume-safe keys), paths.

Imports only :mod:`worldpipe.core`; nothing here imports torch."""
