"""The bridges that the import line alone brings: applied when their client library is imported.

`from gpt2attn import GPT2LMHeadModel` in place of transformers' must be all a user changes, yet
`import gpt2attn` imports neither transformers nor PEFT. So importing gpt2attn calls `install()`,
which puts a finder first on `sys.meta_path`: it loads nothing itself, but once one of the modules
below has finished importing (anywhere, in any order), it imports the bridge module that teaches it
gpt2attn's classes. A client imported before gpt2attn gets its bridge at once. Each bridge changes
what happens to gpt2attn's own models only. GPT2ATTN_NO_IMPORT_HOOKS=1 turns this off (then import
a bridge by hand, e.g. `import gpt2attn.interop.peft`).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec

# module whose import brings the bridge -> the bridge (imported once that module has finished)
BRIDGES = {
    "peft": "gpt2attn.interop.peft",
    "transformers.trainer": "gpt2attn.interop.trainer",
    "transformers.pipelines.base": "gpt2attn.interop.pipeline",
}


def install() -> None:
    """Bridge the clients already imported; watch for the others (unless GPT2ATTN_NO_IMPORT_HOOKS=1)."""
    if os.environ.get("GPT2ATTN_NO_IMPORT_HOOKS", "") not in ("", "0"):
        return
    if not any(isinstance(finder, _BridgeFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BridgeFinder())
    for client, bridge in BRIDGES.items():
        if client in sys.modules:
            _import_bridge(bridge)


def _import_bridge(bridge: str) -> None:
    """Import a bridge; a failure (a client version it does not know) warns, never breaks the user's import."""
    try:
        importlib.import_module(bridge)
    except Exception as e:
        warnings.warn(f"gpt2attn could not apply {bridge} ({type(e).__name__}: {e}); import it by hand to see why",
                      stacklevel=2)


class _BridgeFinder(MetaPathFinder):
    """Finds nothing itself: for a watched module, takes the spec the other finders give and has its
    loader import the bridge right after the module's own code ran."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in BRIDGES:
            return None
        spec = _find_with_others(self, fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenBridge(spec.loader, BRIDGES[fullname])
        return spec


def _find_with_others(me: MetaPathFinder, fullname: str, path, target) -> ModuleSpec | None:
    """The spec the finders after (and before) `me` give, as the import system would without it."""
    for finder in sys.meta_path:
        if finder is me or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


class _ThenBridge(Loader):
    """The module's own loader, then the bridge; the module keeps its own loader afterwards."""

    def __init__(self, loader: Loader, bridge: str):
        self.loader, self.bridge = loader, bridge

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        _import_bridge(self.bridge)
