"""The step pipeline: the stages over a Batch (which of them run: the config's ``Plan``,
``creditrl.workers.plan``)."""
