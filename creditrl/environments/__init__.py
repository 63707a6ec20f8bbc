"""Environments from the hubs, trained unchanged.

- ``verifiers``: a verifiers environment (``env.verifiers=FILE_OR_MODULE:load_environment``,
  ``env.kwargs.*``): its rows are the run's prompts, each trajectory is its rollout against
  creditrl's OpenAI-compatible endpoint (``creditrl.agents.program``, token-exact, drift
  located), its rubric's total is the score and its named parts are extra metrics. A
  ``verifiers.v1`` Env (verifiers 0.4) runs its episodes in process, its harness program's
  model calls reaching the same endpoint (``creditrl.environments.verifiers_v1``).
- ``openenv``: an OpenEnv environment (``env.openenv=FILE_OR_MODULE:EnvClass``, ``:app`` or a
  local server's URL): its first observations by seed are the prompts, each trajectory is one
  episode of reset/step with the policy's replies through the same endpoint, the sum of its
  rewards is the score.

Imports are lazy: ``verifiers`` and ``openenv`` are optional extras (``pip install
'creditrl[verifiers]'``, ``'creditrl[openenv]'``).
"""

from __future__ import annotations

from creditrl.lazy import names_on_first_use

_HOMES = {
    "build_verifiers_rollout": "creditrl.environments.verifiers",
    "environment_datasets": "creditrl.environments.verifiers",
    "load_verifiers_environment": "creditrl.environments.verifiers",
}

__all__ = sorted(_HOMES)


__getattr__ = names_on_first_use(__name__, _HOMES)
