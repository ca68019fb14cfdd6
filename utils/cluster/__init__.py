"""The ranks of one job: rendezvous and collectives, the one-job-per-folder lock, preemption, the job context. Imports the run folder and below."""
