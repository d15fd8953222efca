"""What the contract kits share (:mod:`bytecp.adapters.testing`,
:mod:`bytecp.storage.testing`).

A third-party adapter or storage backend runs a kit by subclassing its
fixtures base; both bases derive from :class:`DeclaredGaps`, so a subclass
names the kit tests its implementation is known to fail (``xfail = {test
name: reason}``) and pytest holds them to it: a declared gap that starts to
pass fails the run (strict), so the list stays true. Imported only by the
kits (it needs pytest); the library never imports it.
"""

from __future__ import annotations

from bytecp.plugins import missing_extra

try:
    import pytest
except ModuleNotFoundError as e:  # the contract extra
    raise missing_extra(e, "contract", __name__) from None

__all__ = ["DeclaredGaps"]


class DeclaredGaps:
    """Mixin of the kits' fixtures bases: strict xfail for the tests named in ``xfail``."""

    #: test name -> reason for a known gap of this implementation
    xfail: dict[str, str] = {}

    @pytest.fixture(autouse=True)
    def _declared_gaps(self, request: pytest.FixtureRequest) -> None:
        reason = self.xfail.get(request.node.originalname)
        if reason:
            request.applymarker(pytest.mark.xfail(reason=reason, strict=True))
