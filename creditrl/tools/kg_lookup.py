"""The ``kg_lookup`` tool: facts about an entity from a local triple file (spec 001's KG setting).

The file is tab-separated ``subject<TAB>relation<TAB>object`` lines (``#`` comments and blank
lines skipped). Lookups are case- and space-insensitive on entity and relation names. A lookup
returns the triples whose subject is the entity, then those whose object is the entity (so
"which country has capital Paris" is one call), at most ``max_results``, one per line as
``subject | relation | object``. An unknown entity is an ordinary answer ("no facts"), not an
error: the policy asked a valid question.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from creditrl.tools.base import Tool, register_tool

__all__ = ["DEFAULT_TRIPLES", "KnowledgeGraph", "kg_lookup_tool", "normalize_entity"]

DEFAULT_TRIPLES = Path(__file__).resolve().parent.parent / "agents" / "data" / "kg_triples.tsv"


def normalize_entity(text: str) -> str:
    """Lower case, single spaces, no surrounding quotes or punctuation: the lookup key."""
    return " ".join(str(text).strip().strip("\"'.?!").lower().replace("_", " ").split())


@dataclass
class KnowledgeGraph:
    """Triples indexed by subject and by object (normalised names)."""

    triples: list[tuple[str, str, str]]
    max_results: int = 20
    _by_subject: dict[str, list[int]] = field(init=False, repr=False)
    _by_object: dict[str, list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_subject, self._by_object = defaultdict(list), defaultdict(list)
        for i, (subject, _, obj) in enumerate(self.triples):
            self._by_subject[normalize_entity(subject)].append(i)
            self._by_object[normalize_entity(obj)].append(i)

    @classmethod
    def from_tsv(cls, path: str | Path, max_results: int = 20) -> KnowledgeGraph:
        """Read a triple file; ValueError names a line without exactly three fields."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"knowledge-graph file {str(path)!r} does not exist")
        triples = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            parts = [p.strip() for p in line.split("\t")]
            if len(parts) != 3 or not all(parts):
                raise ValueError(f"{path} line {number}: expected subject<TAB>relation<TAB>object")
            triples.append((parts[0], parts[1], parts[2]))
        return cls(triples, max_results)

    def entities(self) -> set[str]:
        """Every subject and object name as written in the file."""
        return {t[0] for t in self.triples} | {t[2] for t in self.triples}

    def find(self, entity: str, relation: str | None = None) -> list[tuple[str, str, str]]:
        """Triples about ``entity`` (as subject, then as object), filtered by ``relation``."""
        key = normalize_entity(entity)
        rows = self._by_subject.get(key, []) + self._by_object.get(key, [])
        found = [self.triples[i] for i in dict.fromkeys(rows)]
        if relation:
            rel = normalize_entity(relation)
            found = [t for t in found if normalize_entity(t[1]) == rel]
        return found[: self.max_results]

    def lookup(self, entity: str, relation: str | None = None) -> str:
        """Facts about an entity in the knowledge graph, one "subject | relation | object" a line.

        Args:
            entity: the entity name, e.g. "France"
            relation: optional relation to keep, e.g. "capital"
        """
        found = self.find(entity, relation)
        if not found:
            what = f" with relation {relation!r}" if relation else ""
            return f"No facts found for {entity!r}{what}."
        return "\n".join(" | ".join(t) for t in found)


@register_tool("kg_lookup")
def kg_lookup_tool(path: str | None = None, max_results: int = 20) -> Tool:
    """The ``kg_lookup`` Tool over ``path`` (default: the shipped ``kg_triples.tsv``)."""
    graph = KnowledgeGraph.from_tsv(path or DEFAULT_TRIPLES, max_results)
    return Tool.from_function(graph.lookup, name="kg_lookup")
