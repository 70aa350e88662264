"""Sub-command groups of the `worldpipe` CLI; each module exposes `register(subparsers)`.

Every `worldpipe` invocation builds the whole parser, so these modules import the rooms they call inside each
handler: `worldpipe runs list` must not pay for torch, zarr or MLflow it never uses.
"""
