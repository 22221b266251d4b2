"""`python -m sharded_operator` with its wall clock off by SKEW_SECONDS (negative: behind), as a replica on
a node whose clock has drifted: the Lease times it writes, and the deadlines it keeps, are that far off."""

from __future__ import annotations

import datetime as dt
import os
import sys

from sharded_operator import __main__ as entry  # first: it sets up kopf's registry the handlers register in
from sharded_operator.run import handlers

_SKEW = dt.timedelta(seconds=float(os.environ["SKEW_SECONDS"]))
_real_now = handlers._now
handlers._now = lambda: _real_now() + _SKEW
sys.exit(entry.main())
