"""Views that show every token's quantities (``creditrl explain``).

- ``columns``: each column's header and definition, and the index convention;
- ``view``: ``TokenView`` (one response, token by token) and byte-level token text;
- ``compute``: derived columns (kl, δ, raw GAE advantage, ratio, clip flag), each by its
  defining function in ``creditrl.core``;
- ``example``: the spec 000 worked example; ``from_run``: a run's rollout dump;
  ``from_text``: a prompt and responses scored on the spot with a model (``models``);
- ``table``: terminal tables and TSV; ``html``: the self-contained explain page.
"""
