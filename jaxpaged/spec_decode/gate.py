"""When to speculate: host numpy, no JAX. Two switches from `SpeculativeConfig`:

- the step's batch size: no row speculates in a step that runs more than `disable_by_batch_size` requests (vLLM's
  rule: a large batch already fills the device, and k extra query tokens per row would cost more than they save);
- each request's acceptance: over its last `acceptance_window` verification steps (steps where it proposed at least
  one token), accepted / proposed below `min_acceptance_rate` switches that request off for `acceptance_cooldown` of
  its decode steps (0: for good), after which it starts over with an empty window.

State is per row of the persistent input batch ([R] and [R, window] arrays); the runner calls `reset` when a request
takes a row, `move` when the batch is condensed, and `record` once per decode step with every running row.

    gate = SpeculationGate(spec, max_rows=256)
    if gate.batch_enabled(num_running):
        speculating = gate.allowed(rows)          # [n] bool
    ...
    gate.record(rows, proposed, accepted)         # [n] each: tokens proposed (0 if none) and accepted this step
"""

from __future__ import annotations

import numpy as np

from jaxpaged.spec_decode.config import SpeculativeConfig

_FOREVER = -1  # cooldown_left of a row switched off for good (acceptance_cooldown=0)


class SpeculationGate:
    def __init__(self, spec: SpeculativeConfig, max_rows: int):
        self.spec = spec
        window = spec.acceptance_window
        self.proposed = np.zeros((max_rows, window), np.int32)  # [R, W] ring of the last W verification steps
        self.accepted = np.zeros((max_rows, window), np.int32)  # [R, W]
        self.steps = np.zeros(max_rows, np.int64)  # [R] verification steps recorded since the window was cleared
        self.cooldown_left = np.zeros(max_rows, np.int64)  # [R] decode steps until the row may speculate again

    def batch_enabled(self, num_running: int) -> bool:
        limit = self.spec.disable_by_batch_size
        return limit is None or num_running <= limit

    def allowed(self, rows: np.ndarray) -> np.ndarray:
        """[n] bool: rows not switched off for low acceptance."""
        return self.cooldown_left[np.asarray(rows)] == 0

    def reset(self, rows: np.ndarray) -> None:
        """Rows taken by new requests: empty windows, no cooldown."""
        rows = np.asarray(rows)
        self.proposed[rows] = 0
        self.accepted[rows] = 0
        self.steps[rows] = 0
        self.cooldown_left[rows] = 0

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """A condensed batch: row src[i]'s request now sits in row dst[i]."""
        src, dst = np.asarray(src), np.asarray(dst)
        for array in (self.proposed, self.accepted, self.steps, self.cooldown_left):
            array[dst] = array[src]

    def record(self, rows: np.ndarray, proposed: np.ndarray, accepted: np.ndarray) -> None:
        """One decode step of these rows: `proposed` tokens verified (0: none this step) and `accepted` of them."""
        rows = np.asarray(rows)
        proposed, accepted = np.asarray(proposed), np.asarray(accepted)
        left = self.cooldown_left[rows]
        waiting = left > 0
        self.cooldown_left[rows[waiting]] -= 1
        back = rows[left == 1]  # cooldown over: start again with an empty window
        self.proposed[back] = 0
        self.accepted[back] = 0
        self.steps[back] = 0
        verified = (proposed > 0) & (left == 0)
        rows, proposed, accepted = rows[verified], proposed[verified], accepted[verified]
        slot = self.steps[rows] % self.spec.acceptance_window
        self.proposed[rows, slot] = proposed
        self.accepted[rows, slot] = accepted
        self.steps[rows] += 1
        full = self.steps[rows] >= self.spec.acceptance_window  # judged only on a whole window
        low = self.accepted[rows].sum(-1) < self.spec.min_acceptance_rate * self.proposed[rows].sum(-1)
        off = rows[full & low]
        self.cooldown_left[off] = self.spec.acceptance_cooldown or _FOREVER
