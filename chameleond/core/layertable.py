"""The per-layer profile as prefix sums: any stage's forward, backward and update seconds, and
its resident state, gradient and stashed activation bytes, in O(1) (PAPER.md section 5 for a
slot's memory). Shared by the estimator, the search and the balanced split."""

from __future__ import annotations

from itertools import accumulate

from chameleond.core.spec import JobSpec


class LayerTable:
    """Prefix sums of the per-layer profile: any stage's cost in O(1)."""

    def __init__(self, spec: JobSpec) -> None:
        layers = spec.layers
        self.n_layers = len(layers)
        self._fwd = [0.0, *accumulate(lp.forward_seconds for lp in layers)]
        self._bwd = [0.0, *accumulate(lp.backward_seconds for lp in layers)]
        # Parameters + gradients (m_g = m_p) + optimizer state stay resident on the owner.
        self._state = [0, *accumulate(2 * lp.param_bytes + lp.optimizer_bytes for lp in layers)]
        self._grad = [0, *accumulate(lp.param_bytes for lp in layers)]
        self._act = [0, *accumulate(lp.activation_bytes for lp in layers)]
        self._out = [lp.output_bytes for lp in layers]
        self._upd = [0.0, *accumulate(lp.update_seconds for lp in layers)]

    def forward_seconds(self, first: int, end: int) -> float:
        return self._fwd[end] - self._fwd[first]

    def backward_seconds(self, first: int, end: int) -> float:
        return self._bwd[end] - self._bwd[first]

    def update_seconds(self, first: int, end: int) -> float:
        return self._upd[end] - self._upd[first]

    def state_bytes(self, first: int, end: int) -> int:
        return self._state[end] - self._state[first]

    def gradient_bytes(self, first: int, end: int) -> int:
        return self._grad[end] - self._grad[first]

    def activation_bytes(self, first: int, end: int) -> int:
        return self._act[end] - self._act[first]

    def output_bytes(self, end: int) -> int:
        """Bytes sent downstream per micro-batch by a stage ending before layer `end`."""
        return self._out[end - 1]

    def stage_memory(self, first: int, end: int, stage: int, n_stages: int, n_micro: int) -> int:
        """PAPER.md section 5 for one slot: resident state + stashed activations.

        Stage i stashes at most min(N_pp - i, N_m) micro-batches under 1F1B (its warm-up forwards
        plus the one in flight); a stage with fewer micro-batches than that never holds more.
        """
        in_flight = min(n_stages - stage, n_micro)
        return self.state_bytes(first, end) + in_flight * self.activation_bytes(first, end)
