"""SGLang's decision on a request's key, as the CPU server takes it.

- `decide`: (allowed, status) for a request to one of the CPU server's routes: SGLang's own
  `decide_request_auth` (srt/utils/auth.py, read from the wheel by protocol/wheel.py::auth_rules), or
  `decide_fallback`, the same rules written from it where the wheel is missing (tests compare the two).
  Which routes take the admin key is protocol/tables.py::ADMIN_OPTIONAL.
The client's side (the run's secret, its header) is rollout/sglang/auth.py; cpu/guard.py applies `decide`
before any route runs.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass
from typing import Optional

from mgrpo.rollout.sglang.protocol.tables import ADMIN_OPTIONAL, ALWAYS_OPEN_PREFIXES
from mgrpo.rollout.sglang.protocol.wheel import auth_rules


class _Level(str, enum.Enum):
    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"
    ADMIN_FORCE = "admin_force"


@dataclass(frozen=True)
class _Decision:
    allowed: bool
    error_status_code: int = 401


def _check_bearer(header: Optional[str], expected: str) -> bool:
    if not header:
        return False
    parts = header.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return secrets.compare_digest(parts[1], expected)


def decide_fallback(*, method: str, path: str, authorization_header: Optional[str], api_key: Optional[str],
                    admin_api_key: Optional[str], auth_level) -> _Decision:
    """sglang/srt/utils/auth.py::decide_request_auth (0.5.23), for where the wheel is missing."""
    if method == "OPTIONS" or path.startswith(ALWAYS_OPEN_PREFIXES):
        return _Decision(True)
    level = _Level(getattr(auth_level, "value", auth_level))
    if level == _Level.ADMIN_FORCE:
        if not admin_api_key:
            return _Decision(False, 403)
        return _Decision(_check_bearer(authorization_header, admin_api_key))
    if level == _Level.ADMIN_OPTIONAL:
        if admin_api_key:
            return _Decision(_check_bearer(authorization_header, admin_api_key))
        if api_key:
            return _Decision(_check_bearer(authorization_header, api_key))
        return _Decision(True)
    if api_key:
        return _Decision(_check_bearer(authorization_header, api_key))
    return _Decision(True)


def decide(method: str, path: str, authorization: Optional[str], api_key: Optional[str],
           admin_api_key: Optional[str]) -> tuple[bool, int]:
    """(allowed, status when refused) for a request to one of the CPU server's routes, by SGLang's rules."""
    admin = path in ADMIN_OPTIONAL
    mod = auth_rules()
    if mod is not None:
        level = mod.AuthLevel.ADMIN_OPTIONAL if admin else mod.AuthLevel.NORMAL
        d = mod.decide_request_auth(method=method, path=path, authorization_header=authorization, api_key=api_key,
                                    admin_api_key=admin_api_key, auth_level=level)
    else:
        d = decide_fallback(method=method, path=path, authorization_header=authorization, api_key=api_key,
                            admin_api_key=admin_api_key,
                            auth_level=_Level.ADMIN_OPTIONAL if admin else _Level.NORMAL)
    return d.allowed, d.error_status_code
