"""Starting training: preflight, run lock, torchrun command line, in-process runs, worker lifeline, relay."""
