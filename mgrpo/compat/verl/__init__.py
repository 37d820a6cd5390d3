"""veRL command lines: `mgrpo-train` and `mgrpo-plan` take veRL's keys (see translate.py)."""

from mgrpo.compat.verl.translate import Translation, VerlKeyError, translate

__all__ = ["Translation", "VerlKeyError", "translate"]
