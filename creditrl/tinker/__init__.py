"""A local Tinker service: the unmodified ``tinker`` SDK (and tinker-cookbook recipes) talk to
creditrl's workers, losses, LoRA, HF engine and checkpoints through ``creditrl serve-tinker``.

``server`` (HTTP, ``/api/v1``) -> ``service`` (sessions, models, samplers, futures) ->
``policy`` (one model: creditrl's forward, losses, optimizer and engine) and ``checkpoints``;
``messages``/``wire`` decode and encode the SDK's bodies; ``records`` writes the run folders
``creditrl report`` and ``creditrl explain`` read. See docs/tinker.md.
"""
