"""The kernel's account of this process's mappings (Linux's ``/proc/self/smaps``)."""

from __future__ import annotations

from pathlib import Path

SMAPS = Path("/proc/self/smaps")


def mapping_fields(address: int) -> dict[str, str]:
    """The fields (``Rss``, ``VmFlags``, ...) of the mapping that holds ``address``."""
    fields: dict[str, str] | None = None
    for line in SMAPS.read_text().splitlines():
        head, _, rest = line.partition(" ")
        start, dash, end = head.partition("-")
        if dash and not head.endswith(":"):
            if fields is not None:
                break
            if int(start, 16) <= address < int(end, 16):
                fields = {}
        elif fields is not None:
            fields[head.rstrip(":")] = rest.strip()
    if fields is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return fields


def resident_bytes(address: int) -> int:
    """This process's resident bytes of the mapping that holds ``address``."""
    return int(mapping_fields(address)["Rss"].split()[0]) * 1024


def resident_bytes_of(path: str | Path) -> int:
    """This process's resident bytes of every mapping of the file ``path``: advice on part of
    a mapping splits it in several."""
    total, counting = 0, False
    for line in SMAPS.read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):
            counting = rest.split()[-1] == str(path) if len(rest.split()) >= 5 else False
        elif counting and head == "Rss:":
            total += int(rest.split()[0]) * 1024
    return total
