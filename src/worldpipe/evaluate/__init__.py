"""Evaluation of trained checkpoints: open-loop prediction on held-out data, plots, MLflow records, logged model."""
