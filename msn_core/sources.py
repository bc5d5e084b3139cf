"""Where images come from: one listing of image files for every on-disk source, shared by pretraining
(``training.data.build_dataset``), ``msn-eval``, ``msn-embed`` (torch-free, :mod:`msn_serve.corpus`) and the run
planner. Standard library only: a listing never opens an image, so serving and training list a corpus the same way.

Sources (``data.source``; ``fashion-mnist`` and ``synthetic`` are in-memory datasets and have no listing):

- ``folder``: every image under ``root``, at any depth; no labels. Self-supervised pretraining needs nothing more.
- ``image_folder``: ``root/<class>/**/<image>``; the label is the class folder (sorted), used only by evaluation and
  monitoring, never by the MSN loss. Images directly in ``root`` are ignored, as torchvision's ImageFolder does.
- ``file_list``: a text file (one ``path`` or ``path label`` per line, ``#`` comments; the label is the last
  whitespace-separated field unless it names an image file, or the field after a tab) or a CSV file (``path[,label]``,
  header optional: a first row naming a ``path``/``file``/``image`` column is a header, and then a
  ``label``/``class``/``target`` column is the label). Relative paths are read from ``image_root``, by default the
  list's own folder. The official ImageNet subset files (``n01440764_10026.JPEG``: a bare file name whose prefix
  before ``_`` is its class folder) are recognised and resolved to ``image_root/n01440764/n01440764_10026.JPEG``,
  labelled by that prefix.
- ``glob``: the files a shell-style pattern matches (``photos/**/*.jpg``: ``**`` spans folders), sorted; no labels.
  Names are relative to the pattern's folder part before its first wildcard.
- ``auto``: a file is a ``file_list``; a path that does not exist but has a wildcard (``*?[``) is a ``glob``; a
  directory is an ``image_folder`` when its images all sit exactly one folder
  below it, in at least two folders, and a ``folder`` otherwise. ``SourceListing.describe`` says what was detected.

File names starting with ``.`` (macOS ``._*`` resource forks, ``.DS_Store``) and folders starting with ``.`` are
skipped; symbolic links are followed once. Files are only listed here, never opened: an unreadable image is
skipped and counted by whoever decodes it.
"""

from __future__ import annotations

import csv
import glob
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = [
    "FILE_SOURCES",
    "IMAGE_EXTENSIONS",
    "MEMORY_SOURCES",
    "SOURCES",
    "SourceError",
    "SourceListing",
    "SourceNotFound",
    "list_images",
    "read_file_list",
    "relabel",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
FILE_SOURCES = ("auto", "folder", "image_folder", "file_list", "glob")  # listed from disk by list_images
MEMORY_SOURCES = ("fashion-mnist", "synthetic")  # datasets held in memory (training.data)
SOURCES = FILE_SOURCES + MEMORY_SOURCES

# A split's subfolder, in order of preference: ``root/train`` for pretraining, ``root/val`` or ``root/test`` for
# evaluation. Used when it exists; otherwise ``root`` itself is the split.
SPLIT_FOLDERS = {"train": ("train",), "val": ("val", "test"), "test": ("test", "val")}
PATH_COLUMNS = ("path", "file", "filename", "file_name", "filepath", "image", "image_path", "img")
LABEL_COLUMNS = ("label", "class", "class_name", "target", "category", "y")
_CHECKED_ENTRIES = 64  # entries of a file list whose existence is checked up front


class SourceError(ValueError):
    """A source that cannot be listed (wrong kind, malformed list, no images): the message says what to change."""


class SourceNotFound(SourceError, FileNotFoundError):
    """A folder, list, subset file or the images a list names do not exist."""


@dataclass(frozen=True)
class SourceListing:
    """The images of one source, in a fixed order (sorted walk, or the list's order): image ``i`` is ``files[i]``.

    ``files`` are paths to open (``base`` joined with ``names``); ``names`` are as listed (relative to ``base``, or
    absolute when a list gives absolute paths). ``labels[i]`` indexes ``classes``; both are None for unlabelled
    sources. ``source`` is the resolved kind: ``folder``, ``image_folder``, ``file_list`` or ``glob``.
    """

    source: str
    base: str
    names: list[str]
    files: list[str]
    labels: list[int] | None
    classes: list[str] | None

    def __len__(self) -> int:
        return len(self.files)

    @property
    def labelled(self) -> bool:
        return self.labels is not None

    def describe(self) -> str:
        """One line for logs: how many images, which kind, where, and the classes when labelled."""
        what = {"folder": "unlabelled folder", "image_folder": "image folder", "file_list": "file list",
                "glob": "files matching a pattern under"}[self.source]
        text = f"{len(self.files):,} images, {what} {self.base}"
        if self.classes is not None:
            shown = ", ".join(self.classes[:5]) + (", ..." if len(self.classes) > 5 else "")
            text += f", {len(self.classes)} classes ({shown})"
            if self.source == "image_folder":
                text += "; if these folders are not classes, set data.source=folder"
        return text


def list_images(source: str, root: str | os.PathLike, *, split: str | None = None,
                image_root: str | os.PathLike | None = None, subset: str | os.PathLike | None = None,
                extensions: Sequence[str] = IMAGE_EXTENSIONS) -> SourceListing:
    """List the images of an on-disk source (``auto``, ``folder``, ``image_folder``, ``file_list`` or ``glob``).

    ``root`` is the folder, the list file or the pattern. ``split`` (``train``, ``val``, ``test``) picks
    ``root/<split>`` (for ``val``/``test``: ``root/val`` or ``root/test``) when that folder exists; file lists and
    patterns ignore it. ``image_root``:
    the folder a file list's relative paths are under (default: the list's folder). ``subset``: a text file of
    relative paths or bare file names restricting the listing (every entry must be found). Raises
    FileNotFoundError or ValueError with a message that names the problem; never opens an image.
    """
    if source not in FILE_SOURCES:
        hint = " (an in-memory dataset: build it with training.data.build_dataset)" if source in MEMORY_SOURCES else ""
        raise SourceError(f"source {source!r} is not listed from files{hint}; "
                          f"expected one of {', '.join(FILE_SOURCES)}")
    if source == "glob" or (source == "auto" and not os.path.exists(root) and glob.has_magic(os.fspath(root))):
        listing = _list_glob(os.fspath(root))
        return _select_subset(listing, Path(subset)) if subset is not None else listing
    root = Path(root)
    suffixes = tuple(ext.lower() for ext in extensions)
    if source == "file_list" or (source == "auto" and root.is_file()):
        if not root.is_file():
            raise SourceNotFound(f"file list {root} does not exist")
        listing = _list_file(root, Path(image_root) if image_root is not None else root.parent)
    else:
        if root.is_file():
            raise SourceError(f"{root} is a file: use source file_list (or auto) for a list of images")
        if not root.is_dir():
            raise SourceNotFound(f"{root}: neither an image folder nor a file list")
        folder = _split_folder(root, split)
        names = _walk(folder, suffixes)
        if source == "auto":
            source = "image_folder" if _looks_like_classes(names) else "folder"
        if source == "image_folder":
            listing = _image_folder(folder, names, suffixes)
        else:
            if not names:
                raise SourceNotFound(f"no images ({', '.join(suffixes)}) under {folder}")
            listing = SourceListing("folder", str(folder), names, [os.path.join(folder, n) for n in names], None, None)
    return _select_subset(listing, Path(subset)) if subset is not None else listing


def relabel(listing: SourceListing, classes: Sequence[str]) -> SourceListing:
    """The same images with labels indexing ``classes`` (e.g. the training split's), so two labelled listings agree
    on what label ``k`` means; a class that ``classes`` lacks is an error."""
    if listing.labels is None or listing.classes is None:
        raise SourceError(f"{listing.base}: no labels to map")
    index = {name: i for i, name in enumerate(classes)}
    unknown = sorted(set(listing.classes) - set(index))
    if unknown:
        raise SourceError(f"{listing.base} has classes the training images lack: {unknown[:5]}")
    return replace(listing, labels=[index[listing.classes[k]] for k in listing.labels], classes=list(classes))


# ------------------------------------------------------------------------------------------------------ folders


def _split_folder(root: Path, split: str | None) -> Path:
    for name in SPLIT_FOLDERS.get(split or "", ()):
        if (root / name).is_dir():
            return root / name
    return root


def _walk(folder: Path, suffixes: tuple[str, ...]) -> list[str]:
    """Relative paths of the images under ``folder``: files of a folder (sorted) before its subfolders (sorted)."""
    names: list[str] = []
    real_of: dict[str, str] = {}  # visited folder -> its real path, to recognise a link back up its own branch
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        real = real_of[dirpath] = os.path.realpath(dirpath)
        parent = os.path.dirname(dirpath)
        while parent in real_of:
            if real_of[parent] == real:  # a symbolic link to one of its own ancestors: stop here
                dirnames[:], filenames = [], []
                break
            parent = os.path.dirname(parent)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = os.path.relpath(dirpath, folder)
        names.extend(f if rel == "." else os.path.join(rel, f) for f in sorted(filenames)
                     if not f.startswith(".") and f.lower().endswith(suffixes))
    return names


def _looks_like_classes(names: list[str]) -> bool:
    """ImageFolder layout: every image exactly one folder deep, in at least two folders."""
    parts = [n.split(os.sep) for n in names]
    return bool(parts) and all(len(p) == 2 for p in parts) and len({p[0] for p in parts}) >= 2


def _image_folder(folder: Path, names: list[str], suffixes: tuple[str, ...]) -> SourceListing:
    classes = sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))
    index = {name: i for i, name in enumerate(classes)}
    inside = [n for n in names if os.sep in n and n.split(os.sep, 1)[0] in index]
    if not inside:
        loose = len(names) - len(inside)
        hint = (f"; its {loose} images have no class folder: for images without labels use data.source=folder "
                "(or auto)") if loose else ""
        raise SourceNotFound(f"no images ({', '.join(suffixes)}) found in class subdirectories of {folder}; "
                                f"expected the ImageFolder layout root/<class>/<image>{hint}")
    labels = [index[n.split(os.sep, 1)[0]] for n in inside]
    return SourceListing("image_folder", str(folder), inside, [os.path.join(folder, n) for n in inside], labels,
                         classes)


def _list_glob(pattern: str) -> SourceListing:
    """The files ``pattern`` matches (``**`` recursive), sorted, relative to its folder part before any wildcard."""
    parts = Path(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    base = Path(*parts[:fixed]) if fixed else Path(".")
    files = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise SourceNotFound(f"no files match {pattern!r} (quote the pattern so the shell does not expand it)")
    names = [os.path.relpath(p, base) for p in files]
    return SourceListing("glob", str(base), names, [os.path.join(base, n) for n in names], None, None)


# --------------------------------------------------------------------------------------------------- file lists


def read_file_list(path: str | os.PathLike) -> tuple[list[str], list[str] | None]:
    """``(entries, labels)`` of a text or CSV file list, in its order; labels are None when it has none.

    A list either labels every entry or none: a mix is an error that names the first odd line.
    """
    path = Path(path)
    if path.suffix.lower() in (".csv", ".tsv"):
        rows = _csv_rows(path, "\t" if path.suffix.lower() == ".tsv" else ",")
    else:
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                rows.append((number, *_split_line(line)))
    if not rows:
        raise SourceError(f"file list {path} has no entries (one image path per line, optionally followed by a label)")
    has_label = [label is not None for _, _, label in rows]
    if any(has_label) and not all(has_label):
        odd = rows[has_label.index(not has_label[0])][0]
        first = "has a label but" if has_label[0] else "has no label but"
        raise SourceError(f"{path}: line {rows[0][0]} {first} line {odd} {'has none' if has_label[0] else 'has one'}: "
                         "label every entry or none")
    entries = [entry for _, entry, _ in rows]
    return entries, ([label for _, _, label in rows] if has_label[0] else None)


def _split_line(line: str) -> tuple[str, str | None]:
    """``path``, ``path<TAB>label`` or ``path label`` (the last field is a label unless it names an image file, so a
    path with spaces and no label stays whole)."""
    if "\t" in line:
        entry, label = line.rsplit("\t", 1)
        return entry.strip(), label.strip() or None
    fields = line.rsplit(None, 1)
    if len(fields) == 2 and not fields[1].lower().endswith(IMAGE_EXTENSIONS):
        return fields[0], fields[1]
    return line, None


def _csv_rows(path: Path, delimiter: str) -> list[tuple[int, str, str | None]]:
    with open(path, newline="", encoding="utf-8") as f:
        table = [(n, row) for n, row in enumerate(csv.reader(f, delimiter=delimiter), 1)
                 if row and any(c.strip() for c in row) and not row[0].lstrip().startswith("#")]
    if not table:
        return []
    path_col, label_col = 0, 1
    header = [c.strip().lower() for c in table[0][1]]
    if any(name in header for name in PATH_COLUMNS):
        path_col = next(header.index(name) for name in PATH_COLUMNS if name in header)
        named = [header.index(name) for name in LABEL_COLUMNS if name in header]
        others = [i for i in range(len(header)) if i != path_col]
        label_col = named[0] if named else (others[0] if len(others) == 1 else -1)
        table = table[1:]
    rows = []
    for number, row in table:
        if path_col >= len(row) or not row[path_col].strip():
            raise SourceError(f"{path}: line {number} has no path")
        label = row[label_col].strip() if 0 <= label_col < len(row) else ""
        rows.append((number, row[path_col].strip(), label or None))
    return rows


def _list_file(path: Path, base: Path) -> SourceListing:
    entries, label_names = read_file_list(path)
    names, prefixes = _resolve_entries(path, entries, base)
    label_names = label_names if label_names is not None else prefixes
    labels = classes = None
    if label_names is not None:
        unique = set(label_names)
        classes = sorted(unique, key=int) if all(s.lstrip("-").isdigit() for s in unique) else sorted(unique)
        index = {name: i for i, name in enumerate(classes)}
        labels = [index[name] for name in label_names]
    return SourceListing("file_list", str(base), names, [os.path.join(base, n) for n in names], labels, classes)


def _resolve_entries(path: Path, entries: list[str], base: Path) -> tuple[list[str], list[str] | None]:
    """Names relative to ``base`` and, for an ImageNet subset file, each entry's class prefix.

    Existence is checked on up to 64 evenly spaced entries (a million ``stat`` calls on network storage would take
    minutes): none found is an error, some missing a warning; missing files are then skipped when decoded.
    """
    step = max(1, len(entries) // _CHECKED_ENTRIES)
    sample = entries[::step][:_CHECKED_ENTRIES]
    found = sum(os.path.exists(base / e) for e in sample)
    by_prefix, prefixes = 0, None
    if all("/" not in e and os.sep not in e and "_" in e for e in entries):  # bare names: maybe an ImageNet subset
        by_prefix = sum(os.path.exists(base / e.split("_", 1)[0] / e) for e in sample)
    if by_prefix > found:
        prefixes = [e.split("_", 1)[0] for e in entries]
        entries = [os.path.join(p, e) for p, e in zip(prefixes, entries)]
        found = by_prefix
    if found == 0:
        raise SourceNotFound(
            f"none of the {len(sample)} entries of {path} checked exists under {base} (e.g. {sample[:2]}); relative "
            "paths are read from the list's folder unless data.image_root (--image-root) names another")
    if found < len(sample):
        log.warning("%s: %d of the %d entries checked are missing under %s; missing files are skipped", path,
                    len(sample) - found, len(sample), base)
    return entries, prefixes


# ------------------------------------------------------------------------------------------------------ subsets


def _select_subset(listing: SourceListing, subset: Path) -> SourceListing:
    """Restrict ``listing`` to a subset file's entries (relative paths, or bare names as the official ImageNet
    subsets have), in the subset file's order; every entry must be found."""
    if not subset.is_file():
        raise SourceNotFound(f"subset file {subset} does not exist")
    by_path = {os.path.normpath(name): i for i, name in enumerate(listing.names)}
    by_name = {os.path.basename(name): i for i, name in enumerate(listing.names)}
    entries = [line.strip() for line in subset.read_text(encoding="utf-8").splitlines()
               if line.strip() and not line.lstrip().startswith("#")]
    chosen, missing = [], []
    for entry in entries:
        i = by_path.get(os.path.normpath(entry))
        if i is None and "/" not in entry:
            i = by_name.get(entry)
        (missing if i is None else chosen).append(entry if i is None else i)
    if missing:
        raise SourceNotFound(f"{len(missing)} of {len(entries)} entries of subset file {subset} are not in "
                                f"{listing.base}, e.g. {missing[:3]}")
    if not chosen:
        raise SourceError(f"subset file {subset} has no entries")
    labels = [listing.labels[i] for i in chosen] if listing.labels is not None else None
    return replace(listing, names=[listing.names[i] for i in chosen], files=[listing.files[i] for i in chosen],
                   labels=labels)
