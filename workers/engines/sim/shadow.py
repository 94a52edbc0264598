"""Shadow evidence in the simulated engine: what each lookup method a request did not run would
have done on its output, as the embedded engine replays it (``embedded/lookup/replay.py``).

The sim has no text to match, so it draws the steps the method would have run from its own
tables, as it draws a running lookup sequence's (``SimBatch.step``): the prompt's step plain,
then each step a match with the method's coverage for the request's category, its K proposals
accepted with the method's α up to the first rejection, capped one below the tokens left; a
step without a match is plain. The draws come from a generator of their own, so a request's own
steps and tokens are the same with shadow evidence or without.
"""

from __future__ import annotations

import math
import random

from policies.methods import METHODS, Method, is_lookup
from workers.api.generation import ShadowSteps
from workers.api.sim_config import AcceptanceTable
from workers.api.wire import shadow_of
from workers.engines.sim.roofline import sample_accepted

SHADOW_SEED = 0x5AAD0  # xored into the request's seed: the shadow's draws, apart from its own


def sim_shadow(table: AcceptanceTable, category: str, temperature: float, ran: Method | None, k: int,
               output_tokens: int, rng: random.Random) -> tuple[ShadowSteps, ...]:
    """Each lookup method other than ``ran`` over ``output_tokens`` tokens at K ``k``."""
    out = []
    for method in METHODS:
        if not is_lookup(method) or method == ran:
            continue
        alpha, coverage = table.lookup_alpha(method, category, temperature)
        log_alpha = math.log(alpha) if alpha > 0 else -math.inf
        steps = [(0, 0)]  # the prompt's step: its first token, no proposals whatever the method
        remaining = output_tokens - 1
        while remaining > 0:
            cap = min(k, remaining - 1)
            if cap > 0 and rng.random() < coverage:
                accepted = sample_accepted(rng, log_alpha, cap)
                steps.append((cap, accepted))
                remaining -= min(accepted + 1, remaining)
            else:
                steps.append((0, 0))
                remaining -= 1
        out.append(shadow_of(method, steps))
    return tuple(out)
