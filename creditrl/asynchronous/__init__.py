"""Asynchronous training (spec 003): samplers stream scored groups to a learner over ZeroMQ.

- ``messages``: the wire format (JSON header + safetensors Batch; never pickle);
- ``validation``: the checks every group passes before the learner trusts it (rejection
  reasons);
- ``transport``: ROUTER/DEALER sockets with high-water marks, loopback default, CURVE;
- ``delivery``: the sampler's outbox and the learner's ledger and acknowledgement journal;
- ``staleness``: the learner's group buffer, bounded staleness, batches of whole groups;
- ``weights``: versioned weights on disk (full, merged LoRA, or LoRA adapters);
- ``sampler`` / ``learner``: the two workers; ``settings``: shared checks and paths;
  ``launcher``: ``creditrl async``.

Heavy modules are not imported here; import ``creditrl.asynchronous.learner`` etc. directly.
"""
