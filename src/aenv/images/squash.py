"""Squashing: a contiguous run of overlay lower layers merged into one layer directory.

`merge_layers` builds a directory whose overlay view, stacked in place of the run (above
whatever sits below it), is the view of the run itself. It walks the run top-down the way
overlayfs looks paths up (`fs/overlayfs/namei.c`): for each path, the topmost layer that has
it decides, and the layers below are consulted only while every layer above holds a plain
(non-opaque) directory there. That is the same result as applying the layers bottom first,
one on top of the other, but never reads a subtree that is hidden anyway.

What lands in the new layer:

* **Non-directories** (files, symlinks, FIFOs, sockets, device nodes and 0/0 whiteout devices)
  are hard links to the topmost layer's inode: layers are immutable, so sharing inodes is
  safe, no file data is copied, and hard links inside a layer stay hard links. When a link is
  impossible (`EMLINK`: ext4 allows 65000 links per inode, and the kernel's shared whiteout
  inode can be close to that; `EXDEV`) the entry is copied with its metadata, and every path of
  the merged tree linking to that source inode links to the copy instead.
* **Whiteouts are kept**: layers below the run may hold what they hide. The exception is a
  whiteout inside a directory that comes out opaque: the opaque directory hides everything
  below the run already, so the whiteout is dropped.
* **Directories** take mode, owner, times and xattrs from the topmost layer's directory
  (`trusted.overlay.*` excluded). A directory is **opaque** (`trusted.overlay.opaque=y`) when
  the run's stack at that path ends inside the run: at an opaque directory, or at a
  non-directory (file or whiteout) below a directory — in the original stack that entry hid
  whatever is below the run, and the merged directory must keep hiding it.
* A non-opaque directory that holds whiteouts gets an empty `trusted.overlay.origin`, as the
  kernel itself writes on copy-up when the lower layer cannot encode a file handle. Reason:
  overlayfs filters whiteouts out of `readdir` only in directories it believes may hold
  them — merged from several layers, or carrying an origin xattr. Squashing can turn a
  directory merged from several layers of the run into a single-layer one (when nothing below
  the run has it), and without the marker its whiteouts would show up in listings as ghost
  entries that `stat` cannot find. The value is never followed: origin is only looked up on
  upper layers (and with index=on, which aenv never uses).
* The root directory is never opaque: overlayfs ignores the opaque xattr on a layer's root.
* With `bottom=True` (the run is the whole stack) there is nothing to hide: no whiteouts,
  opaque or origin xattrs at all, the result is a plain tree (see `merge_layers`).

Anything else from overlayfs's own metadata is refused or ignored: a directory with a
`trusted.overlay.redirect` (redirect_dir=on) or `trusted.overlay.opaque=x` (6.7+ xattr
whiteouts) raises `SquashError`; aenv's writable mounts use redirect_dir/metacopy/index off,
so its sealed uppers never have them.

Nothing below `dest` is ever reached through a symlink: `dest` is created here, every entry
is created relative to a descriptor of its directory opened with O_NOFOLLOW (re-pointing a
hard link after a copy uses paths made only of directories created here), and the layers
are read with lstat only (a layer root that is a symlink is refused). Synchronous; call it
with `asyncio.to_thread`.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadRequest, NotFound
from ..fsutil import rmtree
from .layers import LayerError, LayerStore, parse_digest
from .unpack import OPAQUE_XATTR, _is_whiteout_dev

log = logging.getLogger("aenv.images")

SQUASH_TAG = b"aenv-squash-v1"
ORIGIN_XATTR = "trusted.overlay.origin"
REDIRECT_XATTR = "trusted.overlay.redirect"
_OVERLAY_XATTRS = "trusted.overlay."
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


class SquashError(LayerError):
    """Layers could not be merged (bad input, unsupported overlayfs metadata)."""


@dataclass
class SquashStats:
    layers: int = 0  # layers merged
    dirs: int = 0  # directories created (the root not counted)
    opaque_dirs: int = 0
    files: int = 0  # regular files
    size: int = 0  # apparent bytes of regular files
    symlinks: int = 0
    whiteouts: int = 0  # kept
    others: int = 0  # FIFOs, sockets, device nodes
    copied: int = 0  # non-directories copied because they could not be hard-linked
    dropped_whiteouts: int = 0  # they hide nothing: inside opaque directories, or `bottom`


@dataclass
class _Dir:
    rel: str  # path below dest ("" for the root)
    name: str  # name in the parent
    sources: list[str]  # the layers' directories at rel that show through, topmost first
    opaque: bool
    parent: _Dir | None
    fd: int = -1
    whiteouts: bool = False


def squash_digest(digests: Sequence[str], *, bottom: bool = False) -> str:
    """The digest of the layer merged from `digests` (topmost first): sha256 over a version
    tag and the ordered input digests. Layers are immutable, so the same inputs always merge
    to the same content."""
    h = hashlib.sha256(SQUASH_TAG + (b"\0bottom" if bottom else b"") + b"\0")
    for d in digests:
        parse_digest(d)
        h.update(d.encode() + b"\0")
    return f"sha256:{h.hexdigest()}"


def squash_into_store(
    store: LayerStore, digests: Sequence[str], source: str = "squash", *, bottom: bool = False
) -> str:
    """Merges the store's layers `digests` (topmost first) into a new layer of the store
    and returns its digest (`squash_digest`); if it is there already, returns it at once.

    A single layer is returned as it is (unless `bottom`, see `merge_layers`). The layer is built in the store's staging area and
    published with one rename; concurrent calls for the same inputs each build a copy and
    all but the first to publish discard theirs. The caller holds references on the inputs
    (they must not be evicted meanwhile) and takes one on the result. The new layer's
    meta.json size counts its files' bytes although they are shared with the inputs."""
    digests = list(digests)
    if not digests:
        raise BadRequest("no layers to squash")
    for d in digests:
        parse_digest(d)
    if len(digests) == 1 and not bottom:
        if not store.has(digests[0]):
            raise NotFound(f"layer {digests[0]} not found")
        return digests[0]
    digest = squash_digest(digests, bottom=bottom)
    if store.has(digest):
        return digest
    for d in digests:
        if not store.has(d):
            raise NotFound(f"layer {d} not found")
    with store.staging() as stage:
        dest = stage / "rootfs"
        stats = merge_layers([store.path(d) for d in digests], dest, bottom=bottom)
        log.debug("squashed %d layers into %s: %s", len(digests), digest, stats)
        extra = {"squash_of": digests, "squash_bottom": bottom}
        return store.add_dir(dest, digest, mode="move", source=source, extra=extra)


def merge_layers(layers: Sequence[Path], dest: Path, *, bottom: bool = False) -> SquashStats:
    """Merges the layer rootfs directories `layers` (topmost first, overlay lowerdir order)
    into the new directory `dest` (which must not exist; removed again on failure).

    `bottom`: the run is the whole stack, nothing will ever be below the result. Then no
    whiteout, opaque or origin xattr is needed, and none is written: the result is a plain
    tree, usable as a rootfs without overlayfs (which the runtime does for a one-layer
    stack). Stacked above another layer, such a result would not hide that layer's files."""
    if not layers:
        raise SquashError("no layers to merge")
    roots: list[str] = []
    for p in layers:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            raise SquashError(f"layer {p} does not exist") from None
        if not stat.S_ISDIR(st.st_mode):
            raise SquashError(f"layer {p} is not a directory (a symlink is not followed)")
        roots.append(os.fspath(p))
    dest = Path(dest)
    try:
        os.mkdir(dest, 0o700)
    except FileExistsError:
        raise SquashError(f"{dest} exists already") from None
    try:
        return _Merger(roots, dest, bottom=bottom).run()
    except BaseException:
        rmtree(dest)
        raise


class _Merger:
    def __init__(self, roots: list[str], dest: Path, *, bottom: bool) -> None:
        self.roots = roots
        self.dest = dest
        self.bottom = bottom
        self.stats = SquashStats(layers=len(roots))
        # Source inodes (dev, ino) that had to be copied -> the copy (path below dest), and
        # inodes with several links -> the paths below dest that link to them.
        self.copies: dict[tuple[int, int], str] = {}
        self.placed: dict[tuple[int, int], list[str]] = {}
        self.root_fd = -1

    def run(self) -> SquashStats:
        open_fds: list[int] = []
        try:
            self.root_fd = _open_dir(str(self.dest), None)
            open_fds.append(self.root_fd)
            root = _Dir("", "", self.roots, opaque=False, parent=None, fd=self.root_fd)
            # Depth first; a directory is finished (attributes, mtime) after its children.
            stack: list[tuple[_Dir, bool]] = [(root, False)]
            while stack:
                node, children_done = stack.pop()
                if children_done:
                    self._finish(node)
                    if node.parent is not None:
                        os.close(node.fd)
                        open_fds.remove(node.fd)
                    continue
                if node.parent is not None:
                    node.fd = _open_dir(node.name, node.parent.fd)
                    open_fds.append(node.fd)
                stack.append((node, True))
                stack.extend((child, False) for child in reversed(self._fill(node)))
        finally:
            for fd in open_fds:
                os.close(fd)
        return self.stats

    def _fill(self, node: _Dir) -> list[_Dir]:
        """Creates node's entries; returns its subdirectories (created, not filled)."""
        listings: list[dict[str, os.DirEntry[str]]] = []
        for src in node.sources:
            with os.scandir(src) as it:
                listings.append({e.name: e for e in it})
        names: set[str] = set()
        for listing in listings:
            names.update(listing)
        subdirs: list[_Dir] = []
        for name in sorted(names, key=os.fsencode):
            leaf: os.DirEntry[str] | None = None
            dir_sources: list[str] = []
            opaque = False
            for listing in listings:
                entry = listing.get(name)
                if entry is None:
                    continue
                if not entry.is_dir(follow_symlinks=False):
                    if dir_sources:
                        opaque = True  # this non-directory hid what is below the run
                    else:
                        leaf = entry
                    break
                dir_sources.append(entry.path)
                if _is_opaque_dir(entry.path):
                    opaque = True
                    break
            rel = f"{node.rel}/{name}" if node.rel else name
            if dir_sources:
                opaque = opaque and not self.bottom
                os.mkdir(name, 0o700, dir_fd=node.fd)
                self.stats.dirs += 1
                self.stats.opaque_dirs += opaque
                subdirs.append(_Dir(rel, name, dir_sources, opaque, parent=node))
            elif leaf is not None:
                self._leaf(node, name, rel, leaf)
        return subdirs

    def _leaf(self, node: _Dir, name: str, rel: str, entry: os.DirEntry[str]) -> None:
        st = entry.stat(follow_symlinks=False)
        if _is_whiteout_dev(st):
            if node.opaque or self.bottom:
                self.stats.dropped_whiteouts += 1
                return
            node.whiteouts = True
            self.stats.whiteouts += 1
        elif stat.S_ISREG(st.st_mode):
            self.stats.files += 1
            self.stats.size += st.st_size
        elif stat.S_ISLNK(st.st_mode):
            self.stats.symlinks += 1
        else:
            self.stats.others += 1
        key = (st.st_dev, st.st_ino)
        copy = self.copies.get(key)
        try:
            if copy is None:
                _hardlink(entry.path, name, node.fd)
            else:
                _hardlink(copy, name, node.fd, src_dir_fd=self.root_fd)
        except OSError as e:
            if e.errno not in (errno.EMLINK, errno.EXDEV):
                raise
            _copy_entry(entry.path, st, name, node.fd)
            self.stats.copied += 1
            # Paths placed before as links to the same inode move to the copy, so that
            # they stay hard links of each other.
            for other in self.placed.get(key, ()):
                self._relink(other, rel)
            self.copies[key] = rel
        if st.st_nlink > 1:
            self.placed.setdefault(key, []).append(rel)

    def _relink(self, rel: str, target: str) -> None:
        """Points dest's `rel` at `target` (both below dest), keeping its dir's times."""
        parent = os.path.dirname(rel) or "."
        fd = self.root_fd
        pst = os.stat(parent, dir_fd=fd, follow_symlinks=False)
        os.unlink(rel, dir_fd=fd)
        os.link(target, rel, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        os.utime(parent, ns=(pst.st_atime_ns, pst.st_mtime_ns), dir_fd=fd, follow_symlinks=False)

    def _finish(self, node: _Dir) -> None:
        src = node.sources[0]
        st = os.lstat(src)
        fd = node.fd
        os.fchown(fd, st.st_uid, st.st_gid)
        os.fchmod(fd, stat.S_IMODE(st.st_mode))
        _copy_xattrs(src, fd, rel=node.rel or "/")
        if node.opaque:
            os.setxattr(fd, OPAQUE_XATTR, b"y")
        elif node.whiteouts and node.parent is not None:
            os.setxattr(fd, ORIGIN_XATTR, b"")  # "may hold whiteouts" (see the module doc)
        os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def _open_dir(name: str, dir_fd: int | None) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SquashError(f"{name} is no longer a directory (a symlink?)") from None
        raise


def _hardlink(src: str, name: str, dir_fd: int, *, src_dir_fd: int | None = None) -> None:
    os.link(src, name, src_dir_fd=src_dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)


def _is_opaque_dir(path: str) -> bool:
    """Whether overlayfs treats the (non-root) layer directory at path as opaque."""
    names = os.listxattr(path, follow_symlinks=False)
    if REDIRECT_XATTR in names:
        raise SquashError(f"{path} has an overlayfs redirect (redirect_dir=on), not supported")
    if OPAQUE_XATTR not in names:
        return False
    value = os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False)
    if value == b"x":
        raise SquashError(f"{path} uses overlayfs xattr whiteouts (opaque=x), not supported")
    return value == b"y"  # what ovl_is_opaquedir() checks; anything else is not opaque


def _copy_xattrs(src: str, dst: int | str, *, rel: str) -> None:
    """Copies src's xattrs but overlayfs's own (lstat semantics on both sides)."""
    follow = isinstance(dst, int)  # an fd is never "followed"; a path is a /proc/self/fd one
    for name in os.listxattr(src, follow_symlinks=False):
        if name.startswith(_OVERLAY_XATTRS):
            continue
        try:
            value = os.getxattr(src, name, follow_symlinks=False)
            os.setxattr(dst, name, value, follow_symlinks=follow)
        except OSError as e:
            log.warning("squash: cannot copy xattr %s of %s: %s", name, rel, e)


def _copy_entry(src: str, st: os.stat_result, name: str, dir_fd: int) -> None:
    """A copy of the non-directory src (lstat st) as `name` in dir_fd, metadata included."""
    times = (st.st_atime_ns, st.st_mtime_ns)
    if stat.S_ISREG(st.st_mode):
        fin = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fout = os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dir_fd,
            )
            try:
                offset = 0
                while offset < st.st_size:
                    n = os.sendfile(fout, fin, offset, min(_CHUNK, st.st_size - offset))
                    if n == 0:
                        break
                    offset += n
                os.fchown(fout, st.st_uid, st.st_gid)
                os.fchmod(fout, stat.S_IMODE(st.st_mode))
                _copy_xattrs(src, fout, rel=src)
                os.utime(fout, ns=times)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        return
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), name, dir_fd=dir_fd)
    else:  # FIFO, socket, device node, whiteout
        os.mknod(name, st.st_mode, st.st_rdev, dir_fd=dir_fd)
        os.chmod(name, stat.S_IMODE(st.st_mode), dir_fd=dir_fd)
    os.chown(name, st.st_uid, st.st_gid, dir_fd=dir_fd, follow_symlinks=False)
    _copy_xattrs(src, f"/proc/self/fd/{dir_fd}/{name}", rel=src)
    os.utime(name, ns=times, dir_fd=dir_fd, follow_symlinks=False)
