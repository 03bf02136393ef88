"""dsv4: the paged, compressed KV cache of DeepSeek-V4's hybrid attention.

Public entry points::

    from dsv4 import DSV4Config, KVCacheManager
    from dsv4.attention import AttentionSubBlock
"""

from dsv4.errors import DSV4Error
from dsv4.model.config import DSV4Config

__all__ = ["DSV4Config", "DSV4Error", "KVCacheManager"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The manager pulls in torch-heavy modules; import it lazily so `dsv4 plan` starts fast.
    if name == "KVCacheManager":
        from dsv4.cache.manager import KVCacheManager

        return KVCacheManager
    raise AttributeError(name)
