"""How often a slot freed by a finished request is taken again soon: the replica's demand, measured.

An accepted draft token is worth a whole token of throughput only when the slot it frees early
goes to another request. When nobody takes the slot (a closed group of requests, the last ones of
a load), a request that runs ahead leaves the others to finish in a thinner batch, whose steps cost
almost as much as full ones: then a token is worth only what it saves of the batch's remaining
decode time (see ``SpeculationPolicy``'s drain pricing). Which case the replica is in is read from
what its freed slots did, not assumed: a router that keeps it loaded refills a slot within a step or
two, a client that sends a group and waits for all of it does not.
"""

from __future__ import annotations

from collections import deque

__all__ = ["SlotRefills"]

# A freed slot counts as refilled when a request arrives within this many decode steps of it (a
# served client's next request takes a round trip of a few milliseconds, under one CPU step).
REFILL_WITHIN_STEPS = 8
# Weight of history per freed slot: about the last ten frees count.
_REFILL_DECAY = 0.9


class SlotRefills:
    """Decayed share of freed slots that a new request took within :data:`REFILL_WITHIN_STEPS` steps.

    Starts at 1 (a replica under load: every accepted token counts in full, the behaviour before
    this was measured)."""

    def __init__(self, within_steps: int = REFILL_WITHIN_STEPS, decay: float = _REFILL_DECAY):
        self.within_steps = within_steps
        self.decay = decay
        self._share = 1.0
        self._step = 0
        self._open: deque[int] = deque()  # the step each still-unjudged freed slot was freed at

    @property
    def share(self) -> float:
        """Estimated probability that the next slot freed is taken again soon (0..1)."""
        return self._share

    def _observe(self, refilled: bool) -> None:
        self._share = self.decay * self._share + (1.0 - self.decay) * float(refilled)

    def on_step(self) -> None:
        """A decode step is scheduled: frees older than the window were not refilled."""
        self._step += 1
        while self._open and self._step - self._open[0] > self.within_steps:
            self._open.popleft()
            self._observe(False)

    def on_finish(self, num_still_running: int) -> None:
        """A request finished (its slot is free) and ``num_still_running`` others are unfinished.

        When it was the last, the batch has drained: the slots still open were not taken while it
        mattered (a closed group's next group arrives after it), and its own slot says nothing.
        Requests that all end at the same step read as a closed group too, and that is the
        pricing they want: a load of equal-length requests that one of them leaves early
        prefills its replacement alone, not batched with the others' (the refilled 8-greedy
        regime's speculative side ran 59 prefill steps, 1.53 s, against 13, 0.60 s, target-only).
        Drain pricing then drafts them all or none, which keeps them together."""
        if num_still_running > 0:
            self._open.append(self._step)
            return
        while self._open:
            self._open.popleft()
            self._observe(False)

    def on_add(self) -> None:
        """A request arrived: it takes the oldest freed slot still open (if any)."""
        if self._open:
            self._open.popleft()
            self._observe(True)
