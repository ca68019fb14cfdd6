"""The run folder on the shared volume: its layout and atomic writes, the run record, the checkpoints, the files kept beside the model. Imports utils.config and utils.common."""
