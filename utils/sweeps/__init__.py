"""Sweeps: the spec, the trials, and the local, Slurm and Katib back ends. Imports the run folder and below, never training."""
