"""Round robin: the baseline policy. Each model's pool takes turns, whatever the prompt."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class RequestInfo:
    """What a policy may look at. Later policies read prompt_token_ids (prefix affinity)."""
    model: str
    prompt_token_ids: Sequence[int] = ()
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class Decision:
    replica: str
    policy: str
    reason: str
    candidates: tuple[str, ...] = field(default=())

    def as_log(self) -> dict:
        return {"policy": self.policy, "reason": self.reason, "candidates": list(self.candidates)}


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn: dict[str, int] = {}  # per model: how many requests it has routed

    def choose(self, candidates: Sequence[str], request: RequestInfo) -> Decision:
        """Candidates are the healthy replicas serving the model, in config order. A candidate
        that drops out shifts the rotation but never stalls it."""
        if not candidates:
            raise ValueError("no candidates to choose from")
        turn = self._turn.get(request.model, 0)
        self._turn[request.model] = turn + 1
        chosen = candidates[turn % len(candidates)]
        return Decision(chosen, self.name, f"turn {turn % len(candidates) + 1} of {len(candidates)}",
                        tuple(candidates))
