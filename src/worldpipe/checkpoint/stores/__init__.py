"""Checkpoint stores: the interface (:mod:`.base`), a POSIX directory (:mod:`.posix`), an object store (:mod:`.object`)."""
