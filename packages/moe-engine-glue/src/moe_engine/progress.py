"""Progress bars (tqdm) for the long steps: quantizing banks, building a demo model, decoding."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm


def bar(total: int, desc: str, unit: str = "it", disable: bool = False):
    """A tqdm bar on stderr; disabled bars cost nothing."""
    return tqdm(total=total, desc=desc, unit=unit, disable=disable, file=sys.stderr, dynamic_ncols=True, leave=False)
