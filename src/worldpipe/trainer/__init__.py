"""Training: the Trainer (`trainer.trainer`, named steps), its Hydra entry (`trainer.main`), resume, preemption.

Nothing is imported here, so that the light modules (`validation`, `preemption`) cost no torch import.
"""
