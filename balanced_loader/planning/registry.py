"""Policy names and their modules under :mod:`balanced_loader.planning.policies`.

Kept in a leaf module so that :class:`~balanced_loader.planning.config.PlanConfig` can check a
name without importing any policy (the CLI starts fast; numba loads only when a policy runs).
"""

from __future__ import annotations

# policy name -> module under balanced_loader.planning.policies (imported lazily: the CLI starts fast)
POLICIES: dict[str, str] = {
    "greedy": "greedy",
    "maxlen": "maxlen",
    "static-sp": "static_sp",
    "token-kk": "token_kk",
    "mcore-dcp": "mcore_dcp",
    "hydra": "hydra",
    "batch-ada": "batch_ada",
    "flexsp": "flexsp",
    "hydraulis": "hydraulis",
    "pools": "pools",
}
