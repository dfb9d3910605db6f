"""How long a request's next draft should be: the length that gives the most tokens per unit of step cost, given
how often the request's draft tokens have been accepted lately.

A draft of k tokens puts k more rows in the step. On a CPU those rows are not free: on SmolLM2 Q4_1 and a 2-core
Xeon a one-row decode step takes 2.2 ms, a second row adds half of that, each row after it a fifth to two fifths
(6.1 ms for five rows, 12.2 ms for seventeen). A draft that is seldom accepted therefore slows a request down,
and one accepted whole pays more the longer it is. With an acceptance rate a per draft token (the chance the
model's token equals the draft's next, given the ones before did), k tokens yield 1 + a + ... + a^k tokens a
step, at a cost 1 + FIRST_ROW + ROW x (k - 1) steps; the length chosen maximises the ratio, and is 0 (no draft)
where no length beats a plain step.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_ROW = 0.5  # a first draft row's cost, in one-row decode steps
ROW = 0.22  # each further row's
DECAY = 0.7  # the weight of a request's earlier drafts against its latest
PRIOR_HITS, PRIOR_MISSES = 4.0, 1.0  # a new request's odds: 0.8, four tokens' worth of drafts


@dataclass
class DraftOdds:
    """A request's recent drafts: accepted tokens (hits) and rejections (misses), each decayed by DECAY per
    draft; between drafts the odds drift back to the prior, so a request that stopped drafting tries again."""

    hits: float = PRIOR_HITS
    misses: float = PRIOR_MISSES

    @property
    def acceptance(self) -> float:
        return self.hits / (self.hits + self.misses)

    def record(self, drafted: int, accepted: int) -> None:
        self.hits = DECAY * self.hits + accepted
        self.misses = DECAY * self.misses + (accepted < drafted)

    def rest(self) -> None:
        """A step without a draft."""
        self.hits = DECAY * self.hits + (1 - DECAY) * PRIOR_HITS
        self.misses = DECAY * self.misses + (1 - DECAY) * PRIOR_MISSES

    def length(self, most: int) -> int:
        """The draft length (0 .. most) with the most expected tokens per unit of step cost."""
        a = self.acceptance
        best, best_rate, expected, p = 0, 1.0, 1.0, 1.0
        for k in range(1, most + 1):
            p *= a
            expected += p
            rate = expected / (1 + FIRST_ROW + ROW * (k - 1))
            if rate > best_rate:
                best, best_rate = k, rate
        return best
