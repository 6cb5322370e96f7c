"""LongStraw: one GRPO update under a memory bound. No Ray, no mint imports.

`longstraw.scoring` holds the token scoring that the rollout engine and the learner share, so that both score a
token under exactly the same temperature-scaled distribution.
"""

from longstraw.errors import LongStrawError

__all__ = ["LongStrawError"]
