"""Removing a checkpoint and undoing a pointer's replacement, each by a rename.

A rename is atomic and needs no free space, so a crash or a full disk mid-way never
leaves a half-removed checkpoint under its real name, nor a pointer file half-restored.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from stoker.checkpoint.io import write_durable
from stoker.checkpoint.layout import TEMP_PREFIX

__all__ = ["PointerBackup", "remove_folder"]


def remove_folder(path: Path) -> None:
    """Removes a checkpoint folder (or a symlink, never what it points to) all at once.

    The folder is first renamed to a ``.tmp-`` name, so a crash mid-removal never leaves a
    half-deleted checkpoint under its real name; the next save clears the rest.
    """
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    doomed = path.with_name(f"{TEMP_PREFIX}del-{path.name}-{secrets.token_hex(4)}")
    os.rename(path, doomed)
    shutil.rmtree(doomed)


class PointerBackup:
    """The old content of a pointer file, to put back if a save fails after replacing it."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.link: Path | None = None
        self.data: bytes | None = None
        if not target.exists():
            return
        link = target.with_name(f"{TEMP_PREFIX}bak-{target.name}-{secrets.token_hex(4)}")
        try:
            # A hard link restores by rename, which needs no free space.
            os.link(target, link)
            self.link = link
        except OSError:
            self.data = target.read_bytes()

    def restore(self) -> None:
        """Puts the old content back (or removes the file, if there was none)."""
        if self.link is not None:
            os.replace(self.link, self.target)
            # rename() does nothing when both names are links to one file: drop the extra.
            self.link.unlink(missing_ok=True)
            self.link = None
        elif self.data is not None:
            temp = self.target.with_name(f"{TEMP_PREFIX}{secrets.token_hex(4)}")
            write_durable(temp, self.data)
            os.replace(temp, self.target)
        else:
            self.target.unlink(missing_ok=True)

    def discard(self) -> None:
        """Drops the backup once the new content is in place for good."""
        if self.link is not None:
            self.link.unlink(missing_ok=True)
