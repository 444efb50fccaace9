"""Stand-in for SGLang's HookRegistry (sglang/srt/plugins/hook_registry.py, SGLang 0.5.23), the
part REPLACE and AROUND hooks take: register() records the hook, apply_hooks() resolves the dotted
target, takes the last REPLACE registered for it (or the original) and wraps it in every AROUND
hook (hook(original, *args, **kwargs)), and sets the result, also in every module that imported
the original by name."""

import enum
import functools
import pkgutil
import sys
from collections import defaultdict


class HookType(enum.Enum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"


class HookRegistry:
    _hooks: dict = defaultdict(list)
    _patched: set = set()

    @classmethod
    def register(cls, target, hook, hook_type=HookType.AFTER, *, source=None):
        if isinstance(hook, type) and hook_type != HookType.REPLACE:
            raise TypeError("a class can only be used with HookType.REPLACE")
        cls._hooks[target].append((hook_type, hook))

    @classmethod
    def apply_hooks(cls):
        for target, hooks in cls._hooks.items():
            if target in cls._patched:
                continue
            if any(hook_type not in (HookType.REPLACE, HookType.AROUND) for hook_type, _ in hooks):
                raise NotImplementedError("the stand-in applies REPLACE and AROUND hooks only")
            owner_path, name = target.rsplit(".", 1)
            owner = pkgutil.resolve_name(owner_path)
            original = getattr(owner, name)
            replacements = [hook for hook_type, hook in hooks if hook_type == HookType.REPLACE]
            wrapped = replacements[-1] if replacements else original
            for hook in (hook for hook_type, hook in hooks if hook_type == HookType.AROUND):
                wrapped = functools.partial(hook, wrapped)
            setattr(owner, name, wrapped)
            for module in list(sys.modules.values()):
                for attribute, value in list(getattr(module, "__dict__", {}).items()):
                    if value is original:
                        setattr(module, attribute, wrapped)
            cls._patched.add(target)
