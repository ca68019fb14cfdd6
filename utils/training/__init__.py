"""Training: data, model, the Trainer, metrics, predictions. Imports the cluster and below."""
