"""Multi-turn agents (spec 001, 004): the token-in-token-out loop, drift detectors, structured
rewards and demo tasks.

- ``loop``: ``AgentLoop`` (per-sample state machines over turns, asyncio), ``Trajectory``.
- ``rollout``: ``AgentRollout`` (the loop behind the engine's ``generate`` interface).
- ``chat``: ``ChatFormat`` (the template's tool-message text, encoded alone and appended).
- ``parsing``: ``<tool_call>`` blocks and answers in generated text (parsing only).
- ``drift``: re-tokenization and template drift checks, with first divergences.
- ``rewards``: ``StructuredRewardManager`` (turn / global rewards), trajectory scores.
- ``task_rewards``, ``tasks``: the ``calc_multiturn`` and ``kgqa`` demo tasks.
- ``scripted``: ``ScriptedTurnGenerator`` (forced token ids, for tests and demos).

Imports are lazy so ``import creditrl.agents`` stays light.
"""

from __future__ import annotations

from creditrl.lazy import names_on_first_use

__all__ = [
    "AgentLoop",
    "AgentRollout",
    "ChatFormat",
    "ScriptedTurnGenerator",
    "StructuredRewardManager",
    "Trajectory",
    "build_agent_datasets",
    "check_batch",
]

_HOMES = {
    "AgentLoop": "creditrl.agents.loop",
    "Trajectory": "creditrl.agents.loop",
    "AgentRollout": "creditrl.agents.rollout",
    "ChatFormat": "creditrl.agents.chat",
    "ScriptedTurnGenerator": "creditrl.agents.scripted",
    "StructuredRewardManager": "creditrl.agents.rewards",
    "build_agent_datasets": "creditrl.agents.tasks",
    "check_batch": "creditrl.agents.drift",
}


__getattr__ = names_on_first_use(__name__, _HOMES)
