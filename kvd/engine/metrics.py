"""Engine counters: totals since start, a one-minute throughput window and the share of time outside forward."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 60.0


@dataclass
class EngineMetrics:
    num_steps: int = 0
    num_prefill_tokens: int = 0  # prompt tokens actually computed (prefix-cache hits excluded)
    num_generated_tokens: int = 0
    step_s: float = 0.0
    forward_s: float = 0.0
    _recent: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens generated in that step)

    def record_step(
        self, num_prefill_tokens: int, num_generated: int, step_s: float, forward_s: float
    ) -> None:
        self.num_steps += 1
        self.num_prefill_tokens += num_prefill_tokens
        self.num_generated_tokens += num_generated
        self.step_s += step_s
        self.forward_s += forward_s
        now = time.monotonic()
        self._recent.append((now, num_generated))
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()

    def summary(self) -> dict:
        window = sum(n for _, n in self._recent)
        return {
            "num_steps": self.num_steps,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "generation_tokens_per_s_1m": window / WINDOW_S,
            "step_overhead_fraction": 1.0 - self.forward_s / self.step_s if self.step_s else 0.0,
        }
