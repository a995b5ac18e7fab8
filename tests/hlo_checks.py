"""Reading compiled HLO text in tests: copies of the K/V pool, and where an instruction lives."""

from __future__ import annotations

import re


def pool_copies(hlo: str, pool_shape: tuple[int, ...]) -> list[str]:
    """HLO instructions that copy a pool-shaped array (synchronous or asynchronous copies)."""
    dims = ",".join(map(str, pool_shape))
    return [line.strip()[:160] for line in hlo.splitlines()
            if re.search(rf"\[{dims}\]", line) and re.search(r" copy(-start)?\(", line)]


def computations_with(hlo: str, needle: str) -> list[str]:
    """Names of the HLO computations with an instruction containing `needle`."""
    names, current = [], None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%(\S+) ", line)
        if header:
            current = header.group(1)
        elif needle in line and current not in names:
            names.append(current)
    return names
