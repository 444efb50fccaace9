"""Stand-in for SGLang's package of this path: load_plugins runs the general plugins, then applies
the hooks they registered (sglang/srt/plugins/__init__.py, SGLang 0.5.23)."""

from importlib.metadata import entry_points

from .hook_registry import HookRegistry

GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"


def load_plugins() -> None:
    for plugin in entry_points(group=GENERAL_PLUGINS_GROUP):
        plugin.load()()
    HookRegistry.apply_hooks()
