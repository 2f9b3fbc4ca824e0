"""Path safety of an artifact: what a manifest may name and what the server may open because of it.

A manifest comes from storage the server does not control, so nothing in it may reach outside the
artifact: every file path is relative, normalized (no `.`, `..` or empty parts) and unique; the
artifact id (`<model name>/<config hash prefix>`, also a cache path) is made of safe names only; and no
file inside the artifact, nor any folder between it and the artifact root, is a symlink, whether it is
read in place or written into the loader's cache. `manifest_view` then exposes only the files the
manifest lists, so an unlisted file dropped into an artifact (a `model/chat_template.jinja`) is never
read.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from app.errors import ArtifactError

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
CONFIG_HASH_PATTERN = re.compile(r"[0-9a-f]{64}")
_UNSAFE_CHARACTERS = re.compile(r"[\x00-\x1f\x7f\\]")  # control characters, backslash (a Windows separator)


def check_file_path(path: str) -> str:
    """`path` when it is a relative, normalized POSIX path of safe names; else ArtifactError."""
    unsafe = (
        not isinstance(path, str)
        or PurePosixPath(path).is_absolute()
        or any(part in ("", ".", "..") for part in path.split("/"))
        or _UNSAFE_CHARACTERS.search(path) is not None
    )
    if unsafe:
        raise ArtifactError(
            f"the manifest lists the file {path!r}: a file path must be relative and normalized (no '.', "
            "'..' or empty parts), without backslashes or control characters"
        )
    return path


def check_file_paths(paths: Iterable[str]) -> None:
    seen: set[str] = set()
    for path in paths:
        check_file_path(path)
        if path in seen:
            raise ArtifactError(f"the manifest lists the file {path!r} twice")
        seen.add(path)


def check_artifact_id(model_name: object, config_hash: object) -> None:
    """The parts of the artifact id, which also names a folder of the loader's cache."""
    if not isinstance(model_name, str) or not NAME_PATTERN.fullmatch(model_name):
        raise ArtifactError(
            f"the manifest's model_name {model_name!r} must be 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if not isinstance(config_hash, str) or not CONFIG_HASH_PATTERN.fullmatch(config_hash):
        raise ArtifactError(f"the manifest's config_hash {config_hash!r} is not a sha256 hex digest")


def inside(root: Path, relative: str) -> Path:
    """`root / relative` after checking that no existing part of it below `root` is a symlink (a missing
    part is fine: the loader creates it). `relative` must have passed `check_file_path`."""
    path = root
    for part in check_file_path(relative).split("/"):
        path = path / part
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            return root / relative
        if stat.S_ISLNK(mode):
            raise ArtifactError(f"{path} is a symlink: an artifact's files and folders must be real ones")
    return path


def regular_file(root: Path, relative: str) -> Path:
    """`root / relative`, which must exist as a regular file reached through no symlink."""
    path = inside(root, relative)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing") from None
    if not stat.S_ISREG(mode):
        raise ArtifactError(f"{path} is not a regular file")
    return path


def manifest_view(root: Path, paths: Iterable[str]) -> Path:
    """A new folder holding a symlink to each listed (verified) file of the artifact at `root`, and
    nothing else: what the backend, tokenizer and golden check read. `remove_view` deletes it."""
    view = Path(tempfile.mkdtemp(prefix="inf2serve-artifact-"))
    try:
        for relative in paths:
            target = regular_file(root, relative).resolve()
            link = view / relative
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(target, link)
    except BaseException:
        remove_view(view)
        raise
    return view


def remove_view(view: Path) -> None:
    shutil.rmtree(view, ignore_errors=True)
