"""Measured cost curves the policy tests price with:
the AMX CPU's verification costs and the whole-step curve built from them."""

AMX_VERIFY = (1.0, 1.02, 1.01, 1.03, 1.03, 1.04, 1.07, 1.08, 1.10)  # n = 1..9 tokens / 1 token


def curve(verify: tuple[float, ...], c: float) -> tuple[float, ...]:
    """step_cost[K] = verify(K+1 tokens) + K draft forwards of relative cost c."""
    return tuple(round(verify[k] + k * c, 4) for k in range(len(verify)))
