"""How long to wait before starting again a process that ended: pure arithmetic, shared by the
front workers' supervisor and the zygote's keeper (appliance/fronts/supervisor.py, zygote.py).

One that ran ``quick_s`` or longer is started again at once (pause 0). One that ended sooner is
crash-looping: the pause doubles from ``first_s`` up to ``most_s``, so a loop costs a start per
``most_s`` at worst, never a core, and never stops trying.
"""

from __future__ import annotations

QUICK_EXIT_S = 10.0  # a process that ends sooner than this after its start is crash-looping
FIRST_PAUSE_S, MAX_PAUSE_S = 0.5, 30.0


def next_pause(previous: float, ran_s: float, first_s: float = FIRST_PAUSE_S, most_s: float = MAX_PAUSE_S,
               quick_s: float = QUICK_EXIT_S) -> float:
    """The pause before the next start, after one that ran ``ran_s`` (the pause before it:
    ``previous``)."""
    if ran_s >= quick_s:
        return 0.0
    return min(most_s, max(first_s, previous * 2))
