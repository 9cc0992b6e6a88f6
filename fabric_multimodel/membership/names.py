"""A site's name, and the member token made of it (``<site>#<registration>``): the one rule for both, checked
before anything reaches the coordinator, since a name rides in store keys and values and in every log line."""

from __future__ import annotations

import re

#: The longest site name: a name rides in store keys and values, a status page's table and every log line.
MAX_SITE_NAME = 64
_SITE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


#: The rule, as an error says it.
SITE_NAME_RULE = (
    f"a site's name is 1 to {MAX_SITE_NAME} letters, digits, '.', '_' or '-', starting with a letter or digit"
)


def is_site_name(site: object) -> bool:
    """Whether ``site`` is a name a site may have (:data:`SITE_NAME_RULE`).

    Example::

        assert is_site_name("berlin-2") and not is_site_name("<script>")
    """
    return isinstance(site, str) and len(site) <= MAX_SITE_NAME and _SITE_NAME.fullmatch(site) is not None


def check_site_name(site: object) -> str:
    """``site`` when :func:`is_site_name`; else ``ValueError`` saying the rule and showing the name (cut when long),
    before anything is written to the store.

    Example::

        check_site_name("berlin-2")  # 'berlin-2'
    """
    if not is_site_name(site):
        shown = repr(site) if len(repr(site)) <= 80 else f"{repr(site)[:60]}... ({len(str(site))} characters)"
        raise ValueError(f"{SITE_NAME_RULE}; got {shown}")
    return site  # type: ignore[return-value]  # a str: is_site_name said so


def site_of(token: str) -> str:
    """The site name of a member's token (``"berlin#3"`` -> ``"berlin"``)."""
    return token.rpartition("#")[0]


def registration_of(token: str) -> int:
    """The registration number of a member's token (``"berlin#3"`` -> 3)."""
    return int(token.rpartition("#")[2])
