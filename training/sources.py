"""Where images come from: the listing lives in :mod:`msn_core.sources` (standard library only, so the torch-free
``msn-embed`` lists a corpus exactly as pretraining does); this module keeps the names training has always imported.
"""

from __future__ import annotations

from msn_core.sources import (
    FILE_SOURCES,
    IMAGE_EXTENSIONS,
    MEMORY_SOURCES,
    SOURCES,
    SPLIT_FOLDERS,
    SourceError,
    SourceListing,
    SourceNotFound,
    list_images,
    read_file_list,
    relabel,
)

__all__ = [
    "FILE_SOURCES",
    "IMAGE_EXTENSIONS",
    "MEMORY_SOURCES",
    "SOURCES",
    "SPLIT_FOLDERS",
    "SourceError",
    "SourceListing",
    "SourceNotFound",
    "list_images",
    "read_file_list",
    "relabel",
]
