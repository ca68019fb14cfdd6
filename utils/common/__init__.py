"""The bottom layer: errors and exit codes, threads and deadlines, secrets masking, the input-file readers. Imports nothing of utils above it."""
