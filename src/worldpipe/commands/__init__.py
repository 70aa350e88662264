"""Sub-command groups of the `worldpipe` CLI; each module exposes `register(subparsers)`."""
