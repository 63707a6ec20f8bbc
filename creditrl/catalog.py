"""Every registry and config check of the package, made by importing the modules that declare
them: the registries (names, dotted paths and declarations, light: no torch) and the checks
of the layers that own them. ``creditrl/__init__.py`` imports this, so a registry is known by
its kind (``creditrl.registry.registry``) wherever creditrl is imported, and the config layer
below them names none of these modules. A new registry's module is added here."""

import creditrl.agents.checks
import creditrl.agents.registries
import creditrl.asynchronous.checks
import creditrl.core.checks
import creditrl.core.registries
import creditrl.rollout.checks
import creditrl.rollout.registries
import creditrl.rollout.strategies
import creditrl.workers.checks  # noqa: F401
