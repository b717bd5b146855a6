"""Human byte sizes ('5GB', '500MB', '512MiB') as used by shard-size options (save_pretrained, pmz)."""

from __future__ import annotations


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '20KB', '1GiB', or bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().upper()
    for suffix, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3),
                         ("B", 1)):
        if s.endswith(suffix):
            try:
                return int(float(s[: -len(suffix)]) * mult)
            except ValueError:
                break
    try:
        return int(s)
    except ValueError as exc:
        raise ValueError(f"cannot read size {text!r} (use e.g. 5GB, 500MB)") from exc
