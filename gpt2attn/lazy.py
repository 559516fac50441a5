"""Names a package exports but imports only when first used (PEP 562), so that importing the
package stays cheap: `import gpt2attn` and the command line's parser import no torch.

    __getattr__, __dir__ = lazy.exports(__name__, {"GPT2Config": "config", ...})

`from package import NAME` and `package.NAME` import package.config on first use and keep the
value in the package's namespace, so later uses are plain attribute reads.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def exports(package: str, homes: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A module `__getattr__` and `__dir__` for `package`, whose public name N is defined in the
    module `package.homes[N]`; they must be the names of its `__all__`."""
    namespace = vars(sys.modules[package])
    if set(homes) != set(namespace.get("__all__", homes)):
        raise ImportError(f"{package}: __all__ and the names imported on use differ: "
                          f"{sorted(set(homes) ^ set(namespace['__all__']))}")

    def __getattr__(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__
