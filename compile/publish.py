"""Publishing a staged artifact: every file first, `manifest.json` last and only if absent, so a key that
holds a manifest is complete and is never overwritten. Also the alias objects that name a version."""

from __future__ import annotations

import sys
from pathlib import Path

from app.artifacts.loader import ALIASES_DIR, Alias
from app.artifacts.manifest import MANIFEST_NAME, Manifest
from app.artifacts.paths import NAME_PATTERN
from app.artifacts.storage import Store, progress_bar
from app.errors import ArtifactError, ConfigError


def check_name(kind: str, name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise ConfigError(
            f"{kind} {name!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def same_content(a: Manifest, b: Manifest) -> bool:
    return a.config_hash == b.config_hash and set(a.files) == set(b.files)


def published(dest: Store) -> Manifest | None:
    data = dest.read_optional(MANIFEST_NAME)
    return None if data is None else Manifest.loads(data)


def check_not_conflicting(existing: Manifest, manifest: Manifest, dest: Store) -> None:
    if not same_content(existing, manifest):
        raise ArtifactError(
            f"{dest.uri} already holds a different published artifact (config hash "
            f"{existing.config_hash[:16]}..., {len(existing.files)} files); refusing to overwrite it"
        )


def publish(staging_dir: Path, manifest: Manifest, dest: Store) -> bool:
    """Upload the staged files, then the manifest. Returns False when `dest` already held this very
    artifact (identical files: nothing is written), True when it is newly published."""
    existing = published(dest)
    if existing is not None:
        check_not_conflicting(existing, manifest, dest)
        return False
    with progress_bar(manifest.total_bytes, f"publish {manifest.artifact_id}") as bar:
        for entry in manifest.files:
            dest.upload(staging_dir / entry.path, entry.path)
            bar.update(entry.size)
    if not dest.write_new(MANIFEST_NAME, manifest.dumps().encode()):  # another compile won the race
        check_not_conflicting(published(dest) or manifest, manifest, dest)
        return False
    return True


def promote(artifact: Store, manifest: Manifest, alias: str) -> str:
    """Point `<model-dir>/aliases/<alias>` at the artifact; returns the alias URI."""
    aliases = artifact.parent.child(ALIASES_DIR)
    aliases.write_bytes(check_name("alias", alias), Alias.for_manifest(manifest).to_bytes())
    print(f"alias {alias} -> {manifest.artifact_id}", file=sys.stderr)
    return aliases.uri_of(alias)
