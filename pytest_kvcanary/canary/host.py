"""The import path `docs/adapters.md` gave the seam's data types before round five: they moved to
`canary/seam_data.py` ("host" now means CPU memory only). It names the very objects
`pytest_kvcanary.canary.seam` does; new code imports from the seam."""

from __future__ import annotations

from .seam_data import *  # noqa: F401,F403
from .seam_data import __all__  # noqa: F401
