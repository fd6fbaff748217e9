"""KV-cache compression policies. ``make_policy(KVSpec)`` builds one; ``POLICIES`` lists them by name.

Each policy file holds a policy dataclass registered under its recipe name (:mod:`toolkit.kv.registry`); the import
lines at the bottom of this module are the registrations. To add a policy: write one file like ``l2norm.py`` and add
one import here.
"""

from toolkit.kv.registry import (
    COMPOSED,
    NONE,
    POLICIES,
    QUANT_FIELDS,
    allowed_policies,
    make_policy,
    policy_names,
    policy_type,
    register_composed,
    register_policy,
)

# The registrations, one line per policy file (quantized.py also registers streaming's quantized composition).
from toolkit.kv import streaming  # noqa: E402,F401,I001
from toolkit.kv import l2norm  # noqa: E402,F401
from toolkit.kv import head_aware  # noqa: E402,F401
from toolkit.kv import quantized  # noqa: E402,F401
from toolkit.kv import ggml_types  # noqa: E402,F401

__all__ = ["COMPOSED", "NONE", "POLICIES", "QUANT_FIELDS", "allowed_policies", "make_policy", "policy_names",
           "policy_type", "register_composed", "register_policy"]
