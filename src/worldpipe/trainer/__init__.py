"""Training: the :class:`Trainer` (named steps) and the plain-function entry :func:`train`."""

from worldpipe.trainer.trainer import Trainer

__all__ = ["Trainer"]
