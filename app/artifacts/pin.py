"""Pinned artifact references: deploy by digest, as container images are.

`<artifact URI or alias>@sha256:<hex>` names the artifact whose `manifest.json`, byte for byte as stored,
hashes to `<hex>`. A manifest that does not is refused with one error before anything else is read; a
pinned load then verifies every file with a cryptographic digest (`CRYPTOGRAPHIC_FIRST`), so what runs
is exactly what was pinned: the manifest's digest covers every file's recorded digests, and each file is
checked against them. Unpinned loads keep the fast XXH3 check (corruption, not forgery: `digest`).

Which cryptographic digest: BLAKE3 where the manifest records it (compiles record it from schema 3 on,
next to sha256 and XXH3-128), hashed on several threads where the host has cores; sha256 for manifests
that record no BLAKE3 (schema 1 and early schema 3).
"""

from __future__ import annotations

import hashlib
import re

from app.errors import ArtifactError

PIN_SEPARATOR = "@sha256:"
CRYPTOGRAPHIC_FIRST = ("blake3", "sha256")
_HEX = re.compile(r"[0-9a-f]{64}")


def split_pin(reference: str) -> tuple[str, str | None]:
    """`uri@sha256:<hex>` -> (uri, hex); an unpinned reference -> (reference, None)."""
    uri, separator, digest = reference.rpartition(PIN_SEPARATOR)
    if not separator:
        return reference, None
    if not _HEX.fullmatch(digest):
        raise ArtifactError(
            f"artifact reference {reference!r} pins {digest!r}: a pin is '@sha256:' and 64 lowercase "
            "hex digits"
        )
    return uri, digest


def manifest_digest(manifest_bytes: bytes) -> str:
    return hashlib.sha256(manifest_bytes).hexdigest()


def pinned(uri: str, manifest_bytes: bytes) -> str:
    """The pinned form of `uri`, whose manifest is `manifest_bytes` as stored."""
    return f"{split_pin(uri)[0]}{PIN_SEPARATOR}{manifest_digest(manifest_bytes)}"


def check_pin(reference: str, manifest_bytes: bytes) -> None:
    """Refuse a manifest that is not the one `reference` pins (no-op for an unpinned reference)."""
    uri, want = split_pin(reference)
    if want is None:
        return
    got = manifest_digest(manifest_bytes)
    if got != want:
        raise ArtifactError(
            f"artifact {uri} is pinned to sha256:{want}, but its manifest.json hashes to sha256:{got}: "
            "a different or modified artifact. Deploy the pinned reference `inf2serve artifacts promote` "
            "printed for the artifact you mean, or check who rewrote this one."
        )
