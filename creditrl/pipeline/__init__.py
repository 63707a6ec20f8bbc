"""The step pipeline: what a config needs built (``plan``) and the stages over a Batch."""

from creditrl.pipeline.plan import Plan

__all__ = ["Plan"]
