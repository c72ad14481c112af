"""What MoL2 and the two baselines share: one call, `decide(query, options) -> Decision`, and one precedence rule.

    decision = router.decide(RouteQuery(h19, state), options)         # the router picks among `options`
    decision = router.decide(RouteQuery(explicit="coding"), options)  # an explicit adapter wins; no router runs

The query carries what any router may read: MoL2 reads the user turn's H19; MoL decodes after the conversation
state; Contextual MoL reads both. Each router reads what it needs (and says so when it is missing), so benchmarks
and tests call the three alike. The state is only ever read on a copy: routing writes nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from torch import Tensor

from .data import Candidate


@dataclass(frozen=True)
class RouteQuery:
    h19: Tensor | None = None  # (n, C): the encoder's output over the user turn
    state: Any = None  # the conversation with the user turn prefilled (ced's ConversationState)
    explicit: str | None = None  # the adapter the request names: it wins and no router runs

    def need(self, field: str, router: str):
        """The field `router` routes on, or an error that names it (a caller that left it out)."""
        value = getattr(self, field)
        if value is None:
            raise ValueError(f"the {router} router reads the query's {field}, and this query has none")
        return value


@dataclass
class Decision:
    adapter: str | None  # the chosen (or explicit) adapter; None when MoL's text names no option
    routed: bool  # False when an explicit adapter won and no router ran
    index: int = -1  # into the options; -1 when not routed or no option could be parsed
    scores: Tensor | None = None  # (N,) the head's logits
    reason: str = ""  # MoL's decoded text
    ms: float = 0.0  # decision time


def explicit_decision(query: RouteQuery) -> Decision | None:
    """The precedence rule, the one place it is written: a request that names its adapter gets it."""
    return None if query.explicit is None else Decision(query.explicit, routed=False)


class Router(ABC):
    """A router picks one of the options for each query. Subclasses write `route` (one query that names no adapter)
    and `set_options`; `route_batch` when they can route several queries in one pass."""

    name: ClassVar[str]  # as benchmarks and tables print it
    candidates: tuple[Candidate, ...] = ()  # the options currently prepared

    def decide(self, query: RouteQuery, options: Sequence[Candidate]) -> Decision:
        if (decision := explicit_decision(query)) is not None:
            return decision
        self.use_options(options)
        return self.route(query)

    def decide_batch(self, queries: Sequence[RouteQuery], options: Sequence[Candidate]) -> list[Decision]:
        """Precedence per request, not per batch: queries that name an adapter keep it; the others share one
        `route_batch`."""
        decisions = [explicit_decision(q) for q in queries]
        todo = [i for i, d in enumerate(decisions) if d is None]
        if todo:
            self.use_options(options)
            for i, decision in zip(todo, self.route_batch([queries[i] for i in todo])):
                decisions[i] = decision
        return decisions

    def use_options(self, options: Sequence[Candidate]) -> None:
        """Prepare `options` unless they are the ones prepared already (the usual case: one adapter set)."""
        options = tuple(options)
        if not options:
            raise ValueError("no options: a router needs at least one adapter to choose from")
        if options != self.candidates:
            self.set_options(options)

    @abstractmethod
    def set_options(self, candidates: Sequence[Candidate]) -> Any:
        """Make `candidates` the options the next decisions choose from."""

    @abstractmethod
    def route(self, query: RouteQuery) -> Decision:
        """One query that names no adapter, among the options prepared (`self.candidates`)."""

    def route_batch(self, queries: Sequence[RouteQuery]) -> list[Decision]:
        return [self.route(q) for q in queries]
